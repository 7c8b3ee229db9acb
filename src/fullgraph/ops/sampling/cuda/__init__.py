"""The "cuda" farthest-point-sampling backend: a C++/CUDA extension on thread-block clusters."""
