"""One module per op family: the Python wrapper, its fake kernel and its autograd."""
