"""The reference model app for the peers: the weights are loaded when this module is imported.

``uvicorn --workers N modelapp:app`` imports it in every worker (a copy of the
weights each); ``gunicorn --preload modelapp:app`` imports it once in the master
and forks the workers from it (one copy, on whichever node the master ran).
numaserve runs ``numaserve.apps.model:app`` with ``--preload numaserve.apps.model:load``
instead (the same code, loaded once per node in its template).
The weights file is ``$NUMASERVE_MODEL``.
"""

from numaserve.apps.model import app, load

load()

__all__ = ["app"]
