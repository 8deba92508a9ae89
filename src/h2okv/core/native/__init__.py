"""CPU kernels in C (``kernels.c``), built at first use with the system compiler and called
through ctypes: ``build.py`` builds and loads, ``rules.py`` maps a policy's hooks onto the
kernels' codes, ``calls.py`` passes tensors in."""
