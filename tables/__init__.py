"""State tables. Kept free of anything pandas might probe: this package shadows PyTables' import name ``tables``."""
