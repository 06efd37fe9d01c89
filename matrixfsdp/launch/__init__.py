"""The ``matrixfsdp`` command line: ``train``, ``plan``, ``inspect``."""
