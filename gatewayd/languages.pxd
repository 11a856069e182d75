# Cython declarations for languages.py (augmenting: Python ignores this file; make hotpath compiles with it).
cimport cython

@cython.locals(data=str, previous=Py_UCS4, ch=Py_UCS4)
cdef bint _single_spaced(object text) except -1
