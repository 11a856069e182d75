# Cython declarations for pg_scan.py (augmenting: Python ignores this file; make hotpath compiles with it).
cimport cython

@cython.locals(data=str, previous=Py_UCS4, ch=Py_UCS4, dollar=bint)
cpdef bint needs_scan(object text) except -1
