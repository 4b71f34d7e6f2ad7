"""Host services weenv's tests and benchmarks start by hand: Debian's ``dockerd``
(:mod:`weenv.services.dockerd`) and ``docker-registry``
(:mod:`weenv.services.registry`), each with its files under a private temporary
directory and stopped by PID (:mod:`weenv.services.process`)."""
