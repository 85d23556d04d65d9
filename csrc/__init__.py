"""CUDA C++ sources (`*.cu`), installed as the data package `vibeqwen_csrc`; built on first use on a GPU host
(see `vibeqwen_kernels/cuda_build.py`)."""
