# Cython declarations for session.py (augmenting: Python ignores this file; make hotpath compiles with it).
from gatewayd.policy cimport SessionPolicy
from proxies.postgres.framing cimport BackendReader, FrameBatch, FrontendReader
from proxies.postgres.relay cimport ClientSide, ServerSide

cdef class RelaySession:
    cdef public object client
    cdef public object target
    cdef public FrontendReader frontend
    cdef public BackendReader backend
    cdef public ClientSide client_side
    cdef public ServerSide server_side
    cdef public SessionPolicy policy
    cdef public object finished
    cdef public dict _paused
    cdef public dict _busy
    cdef public object _tasks
    cdef public object _deciding
    cdef public object _held
    cdef public double _held_since
    cdef public FrameBatch _client_batch
    cdef public FrameBatch _target_batch
    cpdef _client_work(self, held=*)
    cpdef _target_work(self)
    cpdef _check_recorder(self)

