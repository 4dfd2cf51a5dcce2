"""The reference model app behind a slowed preload (issue 31): ``slowmodel:load`` first waits
SLOWMODEL_S seconds in one plain ``time.sleep`` (no progress report: only numaserve's load beat
says the template is alive, as for a load stuck in one long C call that releases the GIL), then
loads the weights with ``numaserve.apps.model:load``; ``slowmodel:app`` is the model app itself."""

import os
import time

from numaserve.apps.model import app, load as load_model

__all__ = ["app", "load"]


def load() -> None:
    time.sleep(float(os.environ.get("SLOWMODEL_S", "8")))
    load_model()
