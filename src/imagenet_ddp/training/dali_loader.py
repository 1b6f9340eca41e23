"""``loader: dali``: the training batches through NVIDIA DALI, decoding only each crop region.

The sampler's (epoch, index[, repeat]) keys, each sample's crop window and flip are drawn here,
in Python, from the same per-sample seed and with the same draws as the pytorch path
(training.data.SeededAugmentation.key_seed, data.jpeg.RandomResizedCropDecode), and fed to DALI
through ``fn.external_source``: the samples, their order, windows and flips are the same on any
rank or worker count and after a resume (the sampler's skip). DALI decodes the window
(``fn.decoders.image_slice``: ``mixed``, the GPU's decoder, on CUDA; ``cpu`` otherwise), resizes
it with the run's interpolation, flips it and hands uint8 CHW batches on, normalized on the
device as the pytorch path's. Pixels differ from that path by resampling only (it decodes at a
reduced DCT scale first). DALI's own random ops are seeded per operator, not per sample, so every
draw is made here: the auto_augment policy's ops and magnitudes, torchvision's or timm's
RandAugment (training.dali_augment, applied by DALI), random erasing's boxes (erased by
``fn.erase``).

Evaluation (:class:`DaliEvalLoader`: the holdout in training, the evaluate stage, the
preflight's evaluation rate; chosen in training.data.train_loader) reads each rank's shard in
order, the last batch partial, as accuracy.shard_loader's DataLoader; DALI decodes the whole
image (``fn.decoders.image``, ``mixed`` on CUDA) and resamples the center crop of the pytorch
path's eval_transform, its window computed here (:func:`eval_window`), through ``fn.resize``'s
ROI at the resize's scale. Pixels differ from that path's by resampling only.
"""

from __future__ import annotations

import copy
import itertools
import multiprocessing
import re
from types import SimpleNamespace

import numpy as np
import simplejpeg
import torch
from torchvision.transforms import v2

from imagenet_ddp.jobs.signals import ignore_stop_signals, stop_signals_blocked
from imagenet_ddp.training import dali_augment, recipe

_NO_PASS = (-1, iter(()), 0)  # DaliLoader._keys before a pass: (pass, its keys, position)
INTERPOLATION = {"bilinear": "INTERP_LINEAR", "bicubic": "INTERP_CUBIC"}


def sample_window(seed: int, height: int, width: int, crop, hflip: float, erasing=None,
                  policy=None, slots: int = 0):  # fmt: skip
    """(top, left, height, width, flip, erased, draws) of one sample: the draws of the pytorch
    path's RandomResizedCrop box (on the image's size), its flip, its auto_augment ``policy``'s
    ops (``slots`` (op, parameter) pairs: dali_augment.recorded_draws) and then its
    RandomErasing (``erasing``; erased: the (top, left, height, width) on the output, zeros for
    none), from ``seed``, in the order that path's transform draws them
    (recipe.sample_transform). Python's and NumPy's RNGs too where the policy is timm's, seeded
    as training.data.SeededAugmentation seeds them."""
    with recipe.seeded_draws(seed, python_numpy=bool(slots) and dali_augment.is_timm(policy)):
        box = crop.make_params([torch.empty((1, 1, 1)).expand(1, height, width)])
        flip = bool(torch.rand(1) < hflip)
        draws = dali_augment.recorded_draws(policy, crop.size[0], slots) if slots else []
        erased = (0, 0, 0, 0)
        if erasing is not None and torch.rand(1) < erasing.p:
            size = crop.size
            drawn = erasing.make_params([torch.empty((3, 1, 1)).expand(3, *size)])
            erased = (0, 0, 0, 0) if drawn["v"] is None else tuple(drawn[k] for k in "ijhw")
    return box["top"], box["left"], box["height"], box["width"], flip, erased, draws


def source_row(data: bytes, size: int, window: tuple, label: int) -> list:
    """One sample's columns of :meth:`DaliLoader.batch_inputs`: ``data`` (a JPEG) cropped to
    ``window`` (:func:`sample_window`'s) and resized to ``size``, its ``label``."""
    top, left, height, width, flip, erased, draws = window
    row = [data, np.array([left, top], np.float32), np.array([width, height], np.float32),
           np.array(flip, np.int32), np.array([size, size], np.float32),
           np.array(erased[:2], np.float32), np.array(erased[2:], np.float32),
           np.array(label, np.int64)]  # fmt: skip
    for op, parameter in draws:
        row += [np.array(op, np.int32), np.array(parameter, np.float32)]
    return row


class DaliLoader:
    """A rank's training batches, (uint8 NCHW images, int64 targets), as the DataLoader's: one
    pass per ``iter`` over the sampler's keys from its epoch and skip, ``len`` batches."""

    def __init__(self, dataset, sampler, cfg, batch_size: int, workers: int, device):
        self.dataset, self.base, self.sampler, self.cfg = dataset, dataset.base, sampler, cfg
        self.batch_size, self.threads, self.device = batch_size, max(1, workers), device
        self.workers, self.slots = workers, dali_augment.slots(cfg.auto_augment)
        self._pipe, self._passes, self._first, self._keys = None, 0, (0, 0), _NO_PASS

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def _crop(self, size: int):
        return v2.RandomResizedCrop(size, scale=tuple(self.cfg.crop_scale),
                                    ratio=tuple(self.cfg.crop_ratio))  # fmt: skip

    def _erasing(self):
        """The recipe's RandomErasing (its draws only: DALI erases), or None."""
        p = getattr(self.cfg, "random_erasing", 0)
        return v2.RandomErasing(p=p, value=list(recipe.mean_colour(self.cfg))) if p > 0 else None

    def _policy(self, size: int):
        """The run's auto_augment policy at crop ``size`` (its draws only: DALI applies them):
        torchvision's, or timm's RandAugment as the pytorch path builds it."""
        if not self.slots:
            return None
        spec = self.cfg.auto_augment
        if spec.startswith("rand-"):
            mean = recipe.mean_std(self.cfg)[0]
            composed = recipe.timm_rand_augment(spec, size, mean, self.cfg.interpolation)
            return composed.transforms[1]  # the op of recipe.through_pil
        return recipe.POLICIES[spec](v2.InterpolationMode(self.cfg.interpolation))

    def batch_inputs(self, keys: list) -> tuple:
        """The external source's batch: encoded JPEGs, window anchors (x, y) and shapes (w, h),
        flips, output sizes, erased anchors (y, x) and shapes (h, w), labels, then each policy
        slot's op indices and parameters, one per key."""
        size = self.cfg.crop_for_epoch(keys[0][0])
        crop, erasing, policy = self._crop(size), self._erasing(), self._policy(size)
        columns = tuple([] for _ in range(8 + 2 * self.slots))
        for key in keys:
            index = key[1]
            data = self.base.read_bytes(index)
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            seed = self.dataset.key_seed(key)
            window = sample_window(
                seed, height, width, crop, self.cfg.hflip, erasing, policy, self.slots)  # fmt: skip
            row = source_row(data, size, window, int(self.base.targets[index]))
            for column, value in zip(columns, row, strict=True):
                column.append(value)
        return columns

    def pass_start(self, number: int) -> tuple[int, int]:
        """(epoch, skipped steps) of the pipeline's pass ``number``: its first is the sampler's
        when it was built, each next the following epoch from its start (train_epoch's order;
        :meth:`__iter__` builds again where the sampler says otherwise)."""
        epoch, skip = self._first
        return (epoch, skip) if number == 0 else (epoch + number, 0)

    def source(self, info) -> tuple:
        """The external source (in DALI's worker processes with ``workers`` > 0): the batch
        ``info.iteration`` of pass ``info.epoch_idx``; StopIteration after its last. The
        pass's keys are read from the sampler as the batches ask for them (each process asks
        in order), not listed: a preflight's timing pass spans 10**6 epochs (preflight.rank)."""
        first = info.iteration * self.batch_size
        epoch_idx, keys, position = self._keys
        if epoch_idx != info.epoch_idx or first < position:
            sampler = copy.copy(self.sampler)  # in-process: the loader's own is left alone
            sampler.set_epoch(*self.pass_start(info.epoch_idx))
            keys, position = iter(sampler), 0
            if multiprocessing.parent_process() is not None:
                ignore_stop_signals()  # a DALI worker: the rank decides when to stop
        batch = list(itertools.islice(keys, first - position, first - position + self.batch_size))
        self._keys = (info.epoch_idx, keys, first + len(batch))
        if len(batch) < self.batch_size:  # the pass's tail (drop_last)
            raise StopIteration
        return self.batch_inputs(batch)

    def __getstate__(self) -> dict:
        # DALI's workers get the loader, not its pipeline nor a pass under way
        return {**self.__dict__, "_pipe": None, "_keys": _NO_PASS}

    def pipeline(self):
        """The DALI pipeline, built once for the passes that follow (:meth:`pass_start`). With
        ``workers`` > 0 the per-sample draws run in as many spawned worker processes (DALI's
        parallel external source), batches ahead of the decode: in the rank's own thread they
        would cap it at a few thousand img/s, below a GPU's step."""
        from nvidia.dali import pipeline_def

        gpu, interp, device_id = _placement(self.device, self.cfg.interpolation)
        workers = self.workers
        parallel = {"parallel": True, "prefetch_queue_depth": max(2, workers)} if workers else {}

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads,
                      device_id=device_id, seed=self.cfg.seed, py_num_workers=workers,
                      py_start_method="spawn", enable_conditionals=self.slots > 0)  # fmt: skip
        def crops():
            return crop_graph(self.source, self.cfg, self.slots, gpu, interp, parallel)

        self._first, self._passes, self._keys = (self.sampler.epoch, self.sampler.skip), 0, _NO_PASS
        pipe = crops()
        with stop_signals_blocked():  # a worker inherits the mask until it ignores them
            pipe.build()
        return pipe

    def __iter__(self):
        """One pass: the sampler's epoch from its skip. Builds the pipeline (here, not at the
        first batch: inside the caller's stop_signals_blocked) where none is built, where the
        last pass was left unfinished, or where the sampler is not at the pass that follows."""
        following = self._pipe is not None and self.pass_start(self._passes) == (
            self.sampler.epoch, self.sampler.skip)  # fmt: skip
        if not following:
            self._pipe = self.pipeline()
        return self._pass(self._pipe)

    def _pass(self, pipe):
        self._pipe = None  # until the pass ends: one left unfinished is not resumed
        yield from _drain(pipe, self.device)
        self._pipe, self._passes = pipe, self._passes + 1


def crop_graph(source, cfg, slots: int, gpu: bool, interp, parallel: dict):
    """The training batch's DALI graph, (images, labels), from ``source``'s columns
    (:meth:`DaliLoader.batch_inputs`): the window decoded, resized, flipped, the policy's
    drawn ops (after the flip, torchvision's order), uint8 CHW, erased. timm's geometric ops
    fill with the mean (its img_mean), torchvision's with 0."""
    from nvidia.dali import fn, types

    jpegs, anchor, shape, flip, size, erase_at, erase, label, *draws = fn.external_source(
        source=source, num_outputs=8 + 2 * slots, batch=True, batch_info=True, **parallel
    )
    # no EXIF orientation, as simplejpeg (the pytorch path's decoder) reads none
    images = fn.decoders.image_slice(
        jpegs, anchor, shape, axis_names="WH", normalized_anchor=False,
        normalized_shape=False, device="mixed" if gpu else "cpu",
        output_type=types.RGB, adjust_orientation=False)  # fmt: skip
    images = fn.resize(images, size=size, interp_type=interp, antialias=True)
    if draws:
        images = fn.flip(images, horizontal=flip)
        policy_fill = recipe.mean_colour(cfg) if cfg.auto_augment.startswith("rand-") else (0, 0, 0)
        images, flip = dali_augment.apply(images, draws, interp, policy_fill), 0
    images = fn.crop_mirror_normalize(images, mirror=flip, dtype=types.UINT8,
                                      output_layout="CHW")  # fmt: skip
    images = fn.erase(images, anchor=erase_at, shape=erase, axis_names="HW",
                      fill_value=list(recipe.mean_colour(cfg)))  # fmt: skip
    return images, label


def extreme_problems(cfg) -> list[str]:
    """The run's training batch through DALI (:func:`crop_graph`, on DALI's CPU backend: the
    GPU node's graph, other kernels) at each extreme draw recipe.extreme_transforms forces on
    the pytorch path: the window at each end of crop_scale x crop_ratio with flip and erasing
    always, then each op of the policy at each end of its magnitudes in every slot (on the
    smallest window), at each of the run's crops, on a noise and a flat JPEG (landscape,
    portrait); and its evaluation crop of both. One line for the first case that raises."""
    from nvidia.dali import pipeline_def

    slots = dali_augment.slots(cfg.auto_augment)
    interp = _placement(torch.device("cpu"), cfg.interpolation)[1]
    jpegs = _synthetic_jpegs(cfg)
    cases = [c for size in recipe.run_crops(cfg) for c in _extreme_cases(cfg, size, slots, jpegs)]

    def source(info):
        if info.iteration >= len(cases):
            raise StopIteration
        return tuple([value] for value in cases[info.iteration][1])

    # one case a batch, run as it is fed (nothing prefetched): the error is that case's
    @pipeline_def(batch_size=1, num_threads=1, device_id=None, seed=cfg.seed,
                  enable_conditionals=slots > 0, exec_pipelined=False, exec_async=False,
                  prefetch_queue_depth=1)  # fmt: skip
    def forced():
        return crop_graph(source, cfg, slots, False, interp, {})

    label = "pipeline build"
    try:
        pipe = forced()
        pipe.build()
        for case in cases:
            label = case[0]  # the case pipe.run() takes (nothing fed ahead)
            pipe.run()
        label = f"evaluation resize {cfg.eval_resize} crop {cfg.eval_crop}"
        images = SimpleNamespace(read_bytes=jpegs.__getitem__, targets=[0] * len(jpegs))
        shard = SimpleNamespace(dataset=images, indices=range(len(jpegs)))  # as a Subset
        list(DaliEvalLoader(shard, cfg, 1, 1, torch.device("cpu")))
    except Exception as error:  # noqa: BLE001 - any of them would stop the run on its node
        first = _error_line(str(error))
        return [
            f"loader 'dali': its {label} raises {type(error).__name__} on DALI's CPU backend: "
            f"{first}; the run would fail on its node (the same pipeline): change auto_augment, "
            "crop_scale, crop_ratio or the crops, or set loader: pytorch"
        ]
    return []


def _error_line(text: str) -> str:
    """A DALI error's operator and message in one line (the rest is the graph's traceback)."""
    operator = re.search(r"Error in \w+ operator `([^`]+)`", text)
    cause = (text.split("encountered:", 1)[-1].strip().splitlines() or [""])[0]
    cause = re.sub(r'^Assert on ".*" failed: ', "", cause)
    return f"{operator.group(1)}: {cause}" if operator else cause


def _synthetic_jpegs(cfg) -> list[np.ndarray]:
    """recipe.synthetic_images's noise (landscape) and flat (portrait) images as JPEGs."""
    size = max(*recipe.run_crops(cfg), cfg.eval_resize)
    noise, flat = (image for image in recipe.synthetic_images(size) if torch.is_tensor(image))
    encoded = [simplejpeg.encode_jpeg(np.ascontiguousarray(i.permute(1, 2, 0).numpy()))
               for i in (noise, flat)]  # fmt: skip
    return [np.frombuffer(data, np.uint8) for data in encoded]  # as the reader's read_bytes


def _extreme_cases(cfg, size: int, slots: int, jpegs: list):
    """(name, :func:`source_row`) of each case :func:`extreme_problems` runs at crop ``size``
    on ``jpegs``."""
    erasing = v2.RandomErasing(p=1.0) if cfg.random_erasing > 0 else None
    boxes = [(s, r) for s in sorted(set(cfg.crop_scale)) for r in sorted(set(cfg.crop_ratio))]
    smallest = []  # each image's window of the first box: the smallest
    for data in jpegs:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        for scale, ratio in boxes:
            crop = v2.RandomResizedCrop(size, scale=(scale, scale), ratio=(ratio, ratio))
            window = sample_window(0, height, width, crop, 1.0, erasing)[:-1]
            smallest += [(data, window)] if (scale, ratio) == boxes[0] else []
            name = f"training crop scale {scale:g} ratio {ratio:.3g} at crop {size}"
            yield name, source_row(data, size, (*window, [(0, 0.0)] * slots), 0)
    for name, forced in recipe.policy_extremes(cfg, size):
        for seed, (data, window) in enumerate(smallest):  # timm's sign: as the pytorch path's
            with recipe.seeded_draws(seed):
                draws = [dali_augment.forced_draw(forced, size)] * slots
            yield f"training {name} at crop {size}", source_row(data, size, (*window, draws), 0)


def _placement(device, interpolation: str) -> tuple:
    """(on CUDA, DALI's interpolation type, its device_id) of a pipeline on ``device``."""
    from nvidia.dali import types

    gpu = device.type == "cuda"
    return gpu, getattr(types, INTERPOLATION[interpolation]), (device.index or 0) if gpu else None


def _drain(pipe, device):
    """One pass of ``pipe``: its batches, as torch tensors on ``device``, until its source's
    StopIteration ends DALI's epoch; then reset for the next pass."""
    while True:
        try:
            images, labels = pipe.run()
        except StopIteration:
            break
        yield _to_torch(images, device), torch.from_numpy(labels.as_array())
    pipe.reset()


def _to_torch(images, device) -> torch.Tensor:
    """A batch of DALI's output as a torch tensor, on the device it was made on."""
    if device.type != "cuda":
        return torch.from_numpy(images.as_array())
    from nvidia.dali.plugin.pytorch import feed_ndarray

    tensor = images.as_tensor()
    out = torch.empty(tensor.shape(), dtype=torch.uint8, device=device)
    feed_ndarray(tensor, out, cuda_stream=torch.cuda.current_stream(device))
    return out


def eval_window(height: int, width: int, resize: int, crop: int) -> tuple[np.ndarray, ...]:
    """(start, end), (y, x) in the image's pixels, of the center crop the pytorch path's
    eval_transform takes: torchvision's Resize of the shorter side to ``resize`` (the longer
    side truncated, as Resize computes it), then CenterCrop ``crop`` (its offsets rounded)."""
    if height <= width:
        new_h, new_w = resize, int(resize * width / height)
    else:
        new_h, new_w = int(resize * height / width), resize
    top, left = int(round((new_h - crop) / 2.0)), int(round((new_w - crop) / 2.0))
    sy, sx = height / new_h, width / new_w
    start = np.array([top * sy, left * sx], np.float32)
    end = np.array([(top + crop) * sy, (left + crop) * sx], np.float32)
    return start, end


class DaliEvalLoader:
    """A rank's evaluation batches through DALI, as accuracy.shard_loader's DataLoader: the
    shard's samples in order, the last batch partial, (uint8 NCHW center crops, int64
    targets). ``shard``: a Subset of a dataset with ``read_bytes`` and ``targets``; ``cfg``:
    its ``eval_resize``, ``eval_crop``, ``interpolation``. DALI decodes the whole image and
    resamples only the crop's region, at the resize's scale (``fn.resize``'s ROI: its filter
    reads the pixels around the ROI, so the pixels of resizing the whole image, then
    cropping). ``persistent``: one pipeline serves every pass (held between them)."""

    def __init__(self, shard, cfg, batch_size: int, workers: int, device, persistent=False):
        self.base, self.indices = shard.dataset, list(shard.indices)
        self.resize, self.crop = cfg.eval_resize, cfg.eval_crop
        self.interpolation = cfg.interpolation
        self.batch_size, self.threads, self.device = batch_size, max(1, workers), device
        self.persistent, self._pipe = persistent, None

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)  # the last batch too, as DataLoader's

    def batch_inputs(self, indices: list[int]) -> tuple:
        """The external source's batch: encoded JPEGs, the crop's ROI start and end (y, x) in
        each image's pixels, labels."""
        columns = ([], [], [], [])
        for index in indices:
            data = self.base.read_bytes(index)
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            start, end = eval_window(height, width, self.resize, self.crop)
            row = (data, start, end, np.array(int(self.base.targets[index]), np.int64))
            for column, value in zip(columns, row, strict=True):
                column.append(value)
        return columns

    def _batches(self):
        """One pass (a generator function: after ``reset`` DALI calls it again)."""
        for first in range(0, len(self.indices), self.batch_size):
            yield self.batch_inputs(self.indices[first : first + self.batch_size])

    def pipeline(self):
        """The DALI pipeline of the passes (no random op: its seed draws nothing)."""
        from nvidia.dali import fn, pipeline_def, types

        gpu, interp, device_id = _placement(self.device, self.interpolation)

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads,
                      device_id=device_id, seed=0)  # fmt: skip
        def center_crops():
            jpegs, start, end, label = fn.external_source(
                source=self._batches, num_outputs=4, cycle="raise")  # fmt: skip
            # simplejpeg, the pytorch path's decoder, reads no EXIF orientation
            images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu",
                                       output_type=types.RGB, adjust_orientation=False)  # fmt: skip
            images = fn.resize(images, size=[self.crop, self.crop], roi_start=start,
                               roi_end=end, roi_relative=False, interp_type=interp,
                               antialias=True)  # fmt: skip
            return fn.transpose(images, perm=[2, 0, 1]), label

        pipe = center_crops()
        pipe.build()
        return pipe

    def __iter__(self):
        if not self.indices:  # a rank past the set's end: no batch, no pipeline
            return
        # None at the first pass, and after a pass left unfinished (its source mid-way): build
        pipe, self._pipe = self._pipe or self.pipeline(), None
        yield from _drain(pipe, self.device)  # to the source's end: cycle="raise"
        if self.persistent:
            self._pipe = pipe
