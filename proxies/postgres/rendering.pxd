# Cython declarations for rendering.py (augmenting: Python ignores this file; make hotpath compiles with it).
cimport cython
from proxies.postgres.messages cimport DataRow, render_text_row

@cython.locals(text=str)
cpdef str _quote(object value, bint binary)
cpdef str render_row(DataRow row, object formats, object oids, object shapes=*)
cpdef str render_params(str sql, list params, object param_formats)
