# Cython declarations for framing.py (augmenting: Python ignores this file; make hotpath compiles with it).
cimport cython
from proxies.postgres.messages cimport Message, _int32_at

@cython.locals(message=Message)
cdef Message _framed(type cls, object buf, Py_ssize_t start, Py_ssize_t end)

cdef class _FrameBuffer:
    cdef public object _chunks
    cdef public Py_ssize_t _pos
    cdef public Py_ssize_t _available
    cdef public bint _eof
    cdef public object _error
    cdef public Py_ssize_t bytes_copied
    @cython.locals(available=Py_ssize_t, pos=Py_ssize_t, size=Py_ssize_t, kind=Py_ssize_t, length=Py_ssize_t,
                   total=Py_ssize_t, end=Py_ssize_t, first=bytes)
    cpdef Message _typed(self, tuple table, Py_ssize_t limit)
    cpdef Message next_message(self)

cdef class FrontendReader(_FrameBuffer):
    cdef public Py_ssize_t max_message_size
    cdef public Py_ssize_t max_startup_size
    cdef public str phase
    cpdef Message next_message(self)

cdef class BackendReader(_FrameBuffer):
    cdef public Py_ssize_t max_message_size
    cpdef Message next_message(self)

cdef class FrameBatch:
    cdef public list parts
    cdef public object _buf
    cdef public Py_ssize_t _start
    cdef public Py_ssize_t _end
    cpdef add(self, Message message)
    cpdef add_bytes(self, data)
    cpdef list take(self)

