"""JPEG decoding, and the crop that decodes only what it needs. simplejpeg (libjpeg-turbo) is
as fast as ``torchvision.io.decode_jpeg`` (deprecated in 0.29) and TorchCodec with identical
pixels, and exposes DCT-domain downscaling (benchmarks/README.md)."""

from __future__ import annotations

import numpy as np
import simplejpeg
import torch
from torchvision.transforms import v2


def decode_jpeg(data, min_size: tuple[int, int] | None = None) -> torch.Tensor:
    """JPEG bytes -> uint8 RGB image, CHW (a view of the decoder's HWC array); with
    ``min_size`` (height, width), at the smallest DCT scale (1/8 ... 1) that reaches it."""
    height, width = min_size or (0, 0)
    array = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=height, min_width=width)
    return torch.from_numpy(array).permute(2, 0, 1)


class RandomResizedCropDecode(v2.RandomResizedCrop):
    """``v2.RandomResizedCrop`` that also takes the encoded JPEG: the box is drawn first from the
    header's size by its own ``make_params`` (the same draws as on a decoded image), and where
    it is at least 2x the output on both sides the JPEG is decoded at a reduced DCT scale that
    keeps the box output-sized. A decoded tensor takes the plain path."""

    def forward(self, *inputs):
        data = inputs[0] if len(inputs) == 1 else None
        if not isinstance(data, (bytes, np.ndarray)):
            return super().forward(*inputs)
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)  # nothing decoded
        box = self.make_params([torch.empty((1, 1, 1)).expand(1, height, width)])
        factor = 1
        while factor < 8 and min(box["height"] / self.size[0], box["width"] / self.size[1]) >= (
            2 * factor
        ):
            factor *= 2
        if factor == 1:
            image = decode_jpeg(data)
        else:  # libjpeg-turbo rounds scaled sides up
            image = decode_jpeg(data, (-(-height // factor), -(-width // factor)))
        sy, sx = image.shape[1] / height, image.shape[2] / width
        top, left = int(box["top"] * sy), int(box["left"] * sx)
        bottom = top + max(1, min(image.shape[1] - top, round(box["height"] * sy)))
        right = left + max(1, min(image.shape[2] - left, round(box["width"] * sx)))
        region = image[:, top:bottom, left:right]
        if v2.InterpolationMode(self.interpolation) != v2.InterpolationMode.BILINEAR:
            return v2.functional.resize(region, self.size, self.interpolation, antialias=True)
        # The decoder's HWC array is a channels-last CHW view; interpolate resizes it in place
        # of v2.functional.resize, which copies the crop view first (~1.5x slower here).
        return torch.nn.functional.interpolate(
            region[None], size=self.size, mode="bilinear", antialias=self.antialias
        )[0]
