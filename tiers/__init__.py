"""Storage tiers: GPU HBM, host RAM, disk. One interface (`tiers.base.Tier`)."""

from kvstore.tiers.base import BlockEntry, Tier, TierStats
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.host import HostTier

__all__ = ["BlockEntry", "DiskTier", "GpuTier", "HostTier", "Tier", "TierStats"]
