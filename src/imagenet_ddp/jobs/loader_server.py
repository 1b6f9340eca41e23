"""The DataLoader workers' fork server module: what it and every worker import once.

Imported once into the fork server that starts DataLoader workers (see
:func:`imagenet_ddp.jobs.signals.loader_context`): the server, and every worker it forks, ignore the
stop signals and start with torch, torchvision and the datasets already imported."""

import torch  # noqa: F401
import torchvision  # noqa: F401

import imagenet_ddp.data.dataset  # noqa: F401
from imagenet_ddp.jobs.signals import ignore_stop_signals

ignore_stop_signals()
