"""Several built-in engines behind one router, as one engine."""
