"""Batched image augmentations for contrastive views (SimCLR / SupCon style).

FedClassAvg's code builds two random views of every image with torchvision transforms applied
per sample in the data loader: RandomResizedCrop(scale (0.2, 1)), RandomHorizontalFlip, and for
colour data ColorJitter(0.4, 0.4, 0.4, 0.1) with p = 0.8 and RandomGrayscale(p = 0.2). Here the
whole mini-batch, already on the device, is augmented at once: each sample gets its own affine
sampling grid (crop + flip in one ``F.affine_grid`` / ``F.grid_sample`` call) and its own jitter
factors, with no per-sample Python loop. Every draw comes from the ``torch.Generator`` passed in
(the client's, keyed by seed, partition and round), never from torch's global generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# ITU-R 601 luma weights, as torchvision's rgb_to_grayscale.
_LUMA = (0.299, 0.587, 0.114)


@dataclass(frozen=True)
class ViewAugment:
    """Random resized crop + horizontal flip, and for 3-channel inputs colour jitter and
    random grayscale. Defaults are the FedClassAvg code's (SimCLR's) values."""

    crop_scale: tuple[float, float] = (0.2, 1.0)      # fraction of the image area kept
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)  # aspect ratio range of the crop
    flip_p: float = 0.5
    jitter: tuple[float, float, float] = (0.4, 0.4, 0.4)  # brightness, contrast, saturation
    jitter_p: float = 0.8
    grayscale_p: float = 0.2

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        """One random view of every image in ``x [B, C, H, W]`` (same shape), drawn from
        ``generator`` (on ``x``'s device)."""
        x = resized_crop_flip(x, generator, self.crop_scale, self.crop_ratio, self.flip_p)
        if x.shape[1] == 3:  # colour jitter means nothing for grayscale images
            x = color_jitter(x, generator, self.jitter, self.jitter_p, self.grayscale_p)
        return x


def _rand(n: int, generator: torch.Generator, device: torch.device) -> Tensor:
    return torch.rand(n, device=device, generator=generator)


def _uniform(n: int, low: float, high: float, generator: torch.Generator,
             device: torch.device) -> Tensor:
    return _rand(n, generator, device) * (high - low) + low


def resized_crop_flip(x: Tensor, generator: torch.Generator,
                      scale: tuple[float, float] = (0.2, 1.0),
                      ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.5) -> Tensor:
    """Per-sample random resized crop (area fraction in ``scale``, aspect ratio in ``ratio``,
    resized back to H x W with bilinear sampling) and horizontal flip with probability
    ``flip_p``.

    torchvision re-draws a crop that does not fit up to 10 times, then falls back to a
    centre crop; here the crop's sides are clipped to the image instead, which keeps one draw
    per sample (no loop) and the same scale range."""
    b, device = x.shape[0], x.device
    area = _uniform(b, *scale, generator, device)
    log_ratio = _uniform(b, math.log(ratio[0]), math.log(ratio[1]), generator, device)
    aspect = torch.exp(log_ratio)
    # Crop width and height as fractions of the image's (affine_grid's unit is half the side).
    w = torch.sqrt(area * aspect).clamp(max=1.0)
    h = torch.sqrt(area / aspect).clamp(max=1.0)
    # Centre anywhere that keeps the crop inside the image: |c| <= 1 - side.
    cx = (_rand(b, generator, device) * 2 - 1) * (1 - w)
    cy = (_rand(b, generator, device) * 2 - 1) * (1 - h)
    flip = torch.where(_rand(b, generator, device) < flip_p, -1.0, 1.0)
    theta = torch.zeros(b, 2, 3, device=device, dtype=x.dtype)
    theta[:, 0, 0] = w * flip
    theta[:, 0, 2] = cx
    theta[:, 1, 1] = h
    theta[:, 1, 2] = cy
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _gray(x: Tensor) -> Tensor:
    weights = torch.tensor(_LUMA, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    return (x * weights).sum(1, keepdim=True)


def color_jitter(x: Tensor, generator: torch.Generator,
                 strength: tuple[float, float, float] = (0.4, 0.4, 0.4),
                 p: float = 0.8, grayscale_p: float = 0.2) -> Tensor:
    """Per-sample brightness, contrast and saturation jitter (factors in [1 - s, 1 + s]),
    applied to a sample with probability ``p``, then random grayscale with ``grayscale_p``.

    Works on the tensors as the data loader gives them (normalised), so brightness scales the
    normalised values. Hue jitter (0.1 in the reference code) is left out: it needs an
    RGB -> HSV round trip and changes little at 0.1."""
    b, device = x.shape[0], x.device
    apply = (_rand(b, generator, device) < p).to(x.dtype).view(b, 1, 1, 1)

    def factor(s: float) -> Tensor:
        f = _uniform(b, max(0.0, 1 - s), 1 + s, generator, device).to(x.dtype).view(b, 1, 1, 1)
        return apply * f + (1 - apply)  # factor 1 = unchanged for samples not jittered

    brightness, contrast, saturation = strength
    x = x * factor(brightness)
    mean = _gray(x).mean(dim=(2, 3), keepdim=True)
    x = (x - mean) * factor(contrast) + mean
    gray = _gray(x)
    x = (x - gray) * factor(saturation) + gray
    to_gray = (_rand(b, generator, device) < grayscale_p).view(b, 1, 1, 1)
    return torch.where(to_gray, _gray(x).expand_as(x), x)
