"""Storage tiers: GPU HBM, host RAM, disk. One interface (`tiers.base.Tier`)."""

from tiers.base import BlockEntry, Tier, TierStats
from tiers.disk import DiskTier
from tiers.gpu import GpuTier
from tiers.host import HostTier

__all__ = ["BlockEntry", "DiskTier", "GpuTier", "HostTier", "Tier", "TierStats"]
