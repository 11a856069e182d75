# Cython declarations for pump.py (augmenting: Python ignores this file; make hotpath compiles with it).
cimport cython

cpdef bytes data_record(bytes data)
@cython.locals(first=Py_ssize_t, size=Py_ssize_t, at=Py_ssize_t)
cpdef object data_of(bytes record_, Py_ssize_t start, Py_ssize_t end)

cdef class Splice:
    cdef public object done
    cdef public object socket
    cdef public object tunnel
    cdef public object plain
    cdef public object framed
    cdef public bytearray buffer
    cdef public bytes rest
    cdef public bytearray early
    cdef public object ending
    cdef public bint started
    cdef public bint said
    cdef public bint heard
    cdef public bint held
    cdef public object attached
    cpdef send(self, data)
    cpdef say(self, frame)
    cpdef finish(self, exc=*)
    @cython.locals(at=Py_ssize_t, size=Py_ssize_t, length=Py_ssize_t, end=Py_ssize_t)
    cpdef received(self, data)
    cpdef frame(self, frame)
    cpdef broken(self, reason)

cdef class _ProxySide:
    cdef public object transport
