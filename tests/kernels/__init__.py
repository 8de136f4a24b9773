"""Tests of the copy kernels (kernels/): compile, host-shim, layouts, API, GPU."""
