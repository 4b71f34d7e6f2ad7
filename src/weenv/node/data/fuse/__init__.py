"""weenv's own FUSE server (:mod:`.session`, :mod:`.protocol`) and the process
that keeps a FUSE connection alive across daemon restarts (:mod:`.holder`)."""
