# Cython declarations for messages.py (augmenting: Python ignores this file; make hotpath compiles with it).
cimport cython

cdef class Message:
    cdef public object _buf
    cdef public Py_ssize_t _start
    cdef public Py_ssize_t _end
    cdef public object _cache
    cpdef _decoded(self)
    cpdef _decode(self)

cdef class _Empty(Message):
    cpdef _decode(self)

cdef class UnknownMessage(Message):
    pass

cdef class _Untyped(Message):
    pass

cdef class StartupMessage(_Untyped):
    cpdef _decode(self)

cdef class SSLRequest(_Untyped):
    cpdef _decode(self)

cdef class GSSENCRequest(SSLRequest):
    pass

cdef class CancelRequest(_Untyped):
    cpdef _decode(self)

cdef class Query(Message):
    cpdef _decode(self)

cdef class Parse(Message):
    @cython.locals(buf=bytes, start=Py_ssize_t, end=Py_ssize_t, nul=Py_ssize_t, nul2=Py_ssize_t, n=Py_ssize_t,
                   at=Py_ssize_t)
    cpdef _decode(self)

cdef class Bind(Message):
    cpdef _decode(self)
    @cython.locals(buf=bytes, start=Py_ssize_t, end=Py_ssize_t, nul=Py_ssize_t, nul2=Py_ssize_t, pos=Py_ssize_t,
                   n=Py_ssize_t, at=Py_ssize_t, count=Py_ssize_t, size=Py_ssize_t, formats=list, params=list)
    cpdef _decode_fast(self)

cdef class _KindName(Message):
    @cython.locals(buf=bytes, start=Py_ssize_t, end=Py_ssize_t)
    cpdef _decode(self)

cdef class Describe(_KindName):
    pass

cdef class Close(_KindName):
    pass

cdef class Execute(Message):
    @cython.locals(buf=bytes, start=Py_ssize_t, end=Py_ssize_t, nul=Py_ssize_t)
    cpdef _decode(self)

cdef class Sync(_Empty):
    pass

cdef class Flush(_Empty):
    pass

cdef class Terminate(_Empty):
    pass

cdef class CopyData(Message):
    pass

cdef class CopyDone(_Empty):
    pass

cdef class CopyFail(Message):
    cpdef _decode(self)

cdef class FunctionCall(Message):
    cpdef _decode(self)

cdef class PasswordMessage(Message):
    cpdef _decode(self)

cdef class Authentication(Message):
    cpdef _decode(self)

cdef class ParameterStatus(Message):
    cpdef _decode(self)

cdef class BackendKeyData(Message):
    cpdef _decode(self)

cdef class ReadyForQuery(Message):
    cpdef _decode(self)

cdef class RowDescription(Message):
    cpdef _decode(self)

cdef class DataRow(Message):
    cpdef _decode(self)

cdef class CommandComplete(Message):
    @cython.locals(buf=bytes, start=Py_ssize_t, end=Py_ssize_t, tag=str)
    cpdef _decode(self)

cdef class _ErrorOrNotice(Message):
    cpdef _decode(self)

cdef class ErrorResponse(_ErrorOrNotice):
    pass

cdef class NoticeResponse(_ErrorOrNotice):
    pass

cdef class NotificationResponse(Message):
    cpdef _decode(self)

cdef class _CopyResponse(Message):
    cpdef _decode(self)

cdef class CopyInResponse(_CopyResponse):
    pass

cdef class CopyOutResponse(_CopyResponse):
    pass

cdef class CopyBothResponse(_CopyResponse):
    pass

cdef class ParseComplete(_Empty):
    pass

cdef class BindComplete(_Empty):
    pass

cdef class CloseComplete(_Empty):
    pass

cdef class NoData(_Empty):
    pass

cdef class PortalSuspended(_Empty):
    pass

cdef class EmptyQueryResponse(_Empty):
    pass

cdef class ParameterDescription(Message):
    cpdef _decode(self)

cdef class NegotiateProtocolVersion(Message):
    cpdef _decode(self)

cdef class FunctionCallResponse(Message):
    cpdef _decode(self)

@cython.locals(data=bytes)
cpdef str _text(raw)
cpdef Py_ssize_t _int32_at(bytes buf, Py_ssize_t pos)  # cpdef: framing.py cimports it
cdef Py_ssize_t _uint32_at(bytes buf, Py_ssize_t pos)
cdef Py_ssize_t _int16_at(bytes buf, Py_ssize_t pos)
cdef Py_ssize_t _uint16_at(bytes buf, Py_ssize_t pos)
cdef Py_ssize_t NUL_RUN
@cython.locals(stop=Py_ssize_t, at=Py_ssize_t)
cdef Py_ssize_t _nul_at(bytes buf, Py_ssize_t start, Py_ssize_t end) except -2

@cython.locals(buf=bytes, pos=Py_ssize_t, end=Py_ssize_t, count=Py_ssize_t, nformats=Py_ssize_t, i=Py_ssize_t,
               n=Py_ssize_t, stop=Py_ssize_t, parts=list)
cpdef str render_text_row(Message data_row, object formats, str null, str separator, Py_ssize_t max_column_bytes)
