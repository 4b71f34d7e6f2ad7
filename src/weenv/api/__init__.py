"""The wire contract: the request and response models (``models.py``) that the
SDK, the node's server, the node and the cluster all speak.

Sits between :mod:`weenv.formats` and :mod:`weenv.store`: it imports only the
base, host and formats layers, so both ends import it without importing the node.
"""
