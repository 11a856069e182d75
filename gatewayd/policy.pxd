# Cython declarations for policy.py (augmenting: Python ignores this file; make hotpath compiles with it).

cdef class SessionPolicy:
    cdef public object live
    cdef public object rules
    cdef public object recorder
    cdef public str client_ip
    cdef public bint checks_input
    cdef public bint checks_output
    cdef public dict _sql_verdicts
    cdef public object masker
    cdef public object _clear
    cdef public bint waits
    cpdef input(self, data, text=*, bint cache=*, readings=*)
    cpdef record_input(self, data)
    cpdef record_output(self, data)
    cpdef _check_input(self, text, bint cache, readings=*)

