# Cython declarations for relay.py (augmenting: Python ignores this file; make hotpath compiles with it).
cimport cython
from gatewayd.policy cimport SessionPolicy
from proxies.postgres.framing cimport BackendReader, FrameBatch
from proxies.postgres.messages cimport (Bind, CloseComplete, CommandComplete, CopyData, DataRow, Execute, Message,
                                        Parse, Query, ReadyForQuery, RowDescription, render_text_row)
from proxies.postgres.rendering cimport render_params, render_row

cdef class Pending:
    cdef public object error
    cdef public object formats
    cdef public Py_ssize_t kind
    cdef public object mentions
    cdef public object statement

cdef class ClientSide:
    cdef public bint bound
    cdef public dict columns
    cdef public bint discarding
    cdef public object functions
    cdef public Py_ssize_t limit
    cdef public object mentions
    cdef public dict parsed
    cdef public object pending
    cdef public SessionPolicy policy
    cdef public dict portals
    cdef public object prepared
    cdef public object reading
    cdef public dict statements
    cdef public object substitute
    cdef public object verdict
    cdef public object work
    cpdef int on_message(self, Message message)
    cpdef cancel(self, Message message)
    @cython.locals(policy=SessionPolicy)
    cpdef int _query(self, Query query)
    @cython.locals(policy=SessionPolicy)
    cpdef int _parse(self, Parse parse)
    @cython.locals(entry=Pending, policy=SessionPolicy)
    cpdef int _execute(self, Execute execute)
    cpdef int _bind(self, Bind bind)

cdef class WaitingClientSide(ClientSide):
    cdef public object waiting
    cpdef int _query(self, Query query)
    cpdef int _parse(self, Parse parse)

cdef class ServerSide:
    cdef public bint _copy_binary
    cdef public object _desc_formats
    cdef public object _desc_masks
    cdef public object _desc_oids
    cdef public dict _descriptions
    cdef public bint batch_error
    cdef public list blocks
    cdef public dict columns
    cdef public object computed
    cdef public bint cut
    cdef public object formats
    cdef public object header
    cdef public dict holders
    cdef public object masker
    cdef public dict masks
    cdef public object masks_now
    cdef public long long newest
    cdef public object oids
    cdef public list out
    cdef public Py_ssize_t out_chars
    cdef public object pending
    cdef public SessionPolicy policy
    cdef public object reading
    cdef public list replies
    cdef public object sources
    cdef public object sources_for
    cdef public bint target_fatal
    cdef public bint records_later
    cdef public bint recording
    cdef public bint deferring
    cdef public list later
    cdef public object shapes
    cdef public object deep
    cdef public set unknown_types
    cdef public dict learned
    cdef public object catalog_wanted
    cdef public Py_ssize_t row_limit
    cdef public bint unsure
    cdef public bint _fresh
    cdef public int _noticed
    cpdef process(self, BackendReader reader, FrameBatch batch)
    @cython.locals(head=Pending, head_kind=Py_ssize_t, own=bint)
    @cython.locals(head=Pending)
    cpdef _description(self, Message message, FrameBatch batch, bint render)
    @cython.locals(head=Pending)
    cpdef int _row(self, DataRow row, FrameBatch batch)
    cpdef _emit(self, str line)
    cpdef flush_output(self)
    cpdef record_later(self)
    cpdef _cut(self, verdict, FrameBatch batch)
    cpdef _end_result(self)
    @cython.locals(head=Pending)
    cpdef _other(self, Message message, FrameBatch batch, bint render)
    cpdef _command_complete(self, CommandComplete message)
    cpdef tuple _describe(self, RowDescription message, bint mentions)
    cpdef _close_complete(self, CloseComplete message, FrameBatch batch)
    @cython.locals(entry=Pending)
    cpdef _ready(self, ReadyForQuery message, FrameBatch batch)
    cpdef _swallow(self, Message message, FrameBatch batch)
    @cython.locals(head=Pending)
    cpdef _answering(self)
    cpdef _doubt(self)
    cpdef int _copy_out(self, CopyData message, FrameBatch batch)
