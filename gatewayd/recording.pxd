# Cython declarations for recording.py (augmenting: Python ignores this file; make hotpath compiles with it).
cimport cython

cdef class SessionRecorder:
    cdef public object service
    cdef public str session_id
    cdef public double started
    cdef public Py_ssize_t next_seq
    cdef public Py_ssize_t cap
    cdef public Py_ssize_t recorded
    cdef public bint truncated
    cdef public bytearray pending
    cdef public Py_ssize_t pending_count
    cdef public dict pending_sizes
    cdef public bint closed
    cdef public dict metrics
    cdef public str chain_head
    cdef public Py_ssize_t journaled
    cdef public list unstored
    cdef public Py_ssize_t unstored_bytes
    cdef public bint strict
    cdef public double behind_since
    cdef public bint side
    cpdef input(self, data)
    cpdef output(self, data)
    cpdef error(self, data)
    @cython.locals(size=Py_ssize_t, offset=Py_ssize_t, pending=bytearray, text=str)
    cpdef record(self, str kind, data)
