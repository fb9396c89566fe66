"""The data path behind one small interface (``base.Transport``): FlagCX's P2P engine
(``flagcx``) and the same-host transport for host and CUDA memory (``local``).
Nothing here loads a library at import time."""
