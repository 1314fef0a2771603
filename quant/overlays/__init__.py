"""Overlays: the manifest, the builders (MTP INT4, INT6 repack), views of stacked overlays, the Hub."""
