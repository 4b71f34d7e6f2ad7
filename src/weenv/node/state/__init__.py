"""Operations over whole environments: ``snapshot.py``, ``fork.py``,
``reset.py``, ``pause.py``, ``recovery.py`` (after a crash), ``pool.py`` /
``warm.py`` (environments created ahead).

Sits above :mod:`weenv.node.data` and :mod:`weenv.node.runtime`, beside
``snapshotter``, ``resolver``, ``admission`` and ``provision/``.
"""
