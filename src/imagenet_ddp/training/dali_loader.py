"""``loader: dali``: the training batches through NVIDIA DALI, decoding only each crop region.

The sampler's (epoch, index[, repeat]) keys, each sample's crop window and flip are drawn here,
in Python, from the same per-sample seed and with the same draws as the pytorch path
(training.data.SeededAugmentation.key_seed, data.jpeg.RandomResizedCropDecode), and fed to DALI
through ``fn.external_source``: the samples, their order, windows and flips are the same on any
rank or worker count and after a resume (the sampler's skip). DALI decodes the window
(``fn.decoders.image_slice``: ``mixed``, the GPU's decoder, on CUDA; ``cpu`` otherwise), resizes
it with the run's interpolation, flips it and hands uint8 CHW batches on, normalized on the
device as the pytorch path's. Pixels differ from that path by resampling only (it decodes at a
reduced DCT scale first). DALI's own random ops are seeded per operator, not per sample, so the
recipes' auto_augment and random_erasing are refused with it (settings.run_checks).
"""

from __future__ import annotations

import numpy as np
import simplejpeg
import torch
from torchvision.transforms import v2

INTERPOLATION = {"bilinear": "INTERP_LINEAR", "bicubic": "INTERP_CUBIC"}


def dali_problem(cfg) -> str | None:
    """The check job's line where this environment cannot run ``loader: dali``."""
    if getattr(cfg, "loader", "pytorch") != "dali":
        return None
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as error:
        return (
            f"runs[].loader 'dali': nvidia.dali does not import in the jobs' environment "
            f"({error}); install imagenet-ddp[dali] there, or set loader: pytorch"
        )
    return None


def sample_window(seed: int, height: int, width: int, crop, hflip: float) -> tuple:
    """(top, left, height, width, flip) of one sample: the draws of the pytorch path's
    RandomResizedCrop box (on the image's size) and then its flip, from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        box = crop.make_params([torch.empty((1, 1, 1)).expand(1, height, width)])
        flip = bool(torch.rand(1) < hflip)
    return box["top"], box["left"], box["height"], box["width"], flip


class DaliLoader:
    """A rank's training batches, (uint8 NCHW images, int64 targets), as the DataLoader's: one
    pass per ``iter`` over the sampler's keys from its epoch and skip, ``len`` batches."""

    def __init__(self, dataset, sampler, cfg, batch_size: int, workers: int, device):
        self.dataset, self.base, self.sampler, self.cfg = dataset, dataset.base, sampler, cfg
        self.batch_size, self.threads, self.device = batch_size, max(1, workers), device

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def _crop(self, size: int):
        return v2.RandomResizedCrop(size, scale=tuple(self.cfg.crop_scale),
                                    ratio=tuple(self.cfg.crop_ratio))  # fmt: skip

    def batch_inputs(self, keys: list) -> tuple:
        """The external source's batch: encoded JPEGs, window anchors (x, y) and shapes (w, h),
        flips, output sizes and labels, one entry per key."""
        size = self.cfg.crop_for_epoch(keys[0][0])
        crop, columns = self._crop(size), ([], [], [], [], [], [])
        for key in keys:
            index = key[1]
            data = self.base.read_bytes(index)
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            seed = self.dataset.key_seed(key)
            top, left, h, w, flip = sample_window(seed, height, width, crop, self.cfg.hflip)
            row = (data, np.array([left, top], np.float32), np.array([w, h], np.float32),
                   np.array(flip, np.int32), np.array([size, size], np.float32),
                   np.array(int(self.base.targets[index]), np.int64))  # fmt: skip
            for column, value in zip(columns, row, strict=True):
                column.append(value)
        return columns

    def _batches(self):
        keys = list(iter(self.sampler))
        for first in range(0, len(self) * self.batch_size, self.batch_size):
            yield self.batch_inputs(keys[first : first + self.batch_size])

    def pipeline(self):
        """The DALI pipeline of one pass (built per pass: its source is that pass's keys)."""
        from nvidia.dali import fn, pipeline_def, types

        gpu = self.device.type == "cuda"
        interp = getattr(types, INTERPOLATION[self.cfg.interpolation])
        device_id = (self.device.index or 0) if gpu else None

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads,
                      device_id=device_id, seed=self.cfg.seed)  # fmt: skip
        def crops():
            jpegs, anchor, shape, flip, size, label = fn.external_source(
                source=self._batches(), num_outputs=6, cycle=False)  # fmt: skip
            images = fn.decoders.image_slice(
                jpegs, anchor, shape, axis_names="WH", normalized_anchor=False,
                normalized_shape=False, device="mixed" if gpu else "cpu",
                output_type=types.RGB)  # fmt: skip
            images = fn.resize(images, size=size, interp_type=interp, antialias=True)
            images = fn.crop_mirror_normalize(images, mirror=flip, dtype=types.UINT8,
                                              output_layout="CHW")  # fmt: skip
            return images, label

        pipe = crops()
        pipe.build()
        return pipe

    def __iter__(self):
        pipe = self.pipeline()
        for _ in range(len(self)):
            images, labels = pipe.run()
            yield _to_torch(images, self.device), torch.from_numpy(labels.as_array())


def _to_torch(images, device) -> torch.Tensor:
    """A batch of DALI's output as a torch tensor, on the device it was made on."""
    if device.type != "cuda":
        return torch.from_numpy(images.as_array())
    from nvidia.dali.plugin.pytorch import feed_ndarray

    tensor = images.as_tensor()
    out = torch.empty(tensor.shape(), dtype=torch.uint8, device=device)
    feed_ndarray(tensor, out, cuda_stream=torch.cuda.current_stream(device))
    return out
