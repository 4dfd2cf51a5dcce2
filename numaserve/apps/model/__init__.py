"""The reference model app: real weights in a safetensors file, a small numpy transformer, the OpenAI API.

    numaserve model init /srv/models/ref.safetensors --size 2GB
    NUMASERVE_MODEL=/srv/models/ref.safetensors \\
        numaserve start --app numaserve.apps.model:app --preload numaserve.apps.model:load

``load`` (the preload hook) reads ``$NUMASERVE_MODEL`` into memory owned by
the node's warm template; ``app`` serves it.  Modules: ``shape`` (sizes and
tensor list), ``weights`` (file writer and loader), ``tokenizer``,
``network`` (the forward pass), ``engine`` (the loaded model and its thread
pool), ``server`` (the ASGI app).
"""

from numaserve.apps.model.engine import MODEL_ENV, load
from numaserve.apps.model.server import app

__all__ = ["MODEL_ENV", "app", "load"]
