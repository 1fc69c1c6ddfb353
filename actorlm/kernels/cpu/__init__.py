"""The CPU wing: C++ kernels (``csrc/``) behind ctypes, with torch paths where they are not built."""
