"""The `art-mega` launchers: program loading, the launch context, and the controller loop."""

from art_mega.launch.context import ArtLaunchContext

__all__ = ["ArtLaunchContext"]
