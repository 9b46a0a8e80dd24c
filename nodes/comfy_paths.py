"""ComfyUI's folders (``folder_paths``): the user directory the pack's caches live under."""
from __future__ import annotations

import folder_paths


def user_directory() -> str:
    return folder_paths.get_user_directory()
