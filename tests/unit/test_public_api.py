"""What docs/API.md promises of the package's public names."""

from __future__ import annotations

import pytest


def test_the_errors_docs_name_import_from_kvstore_and_a_misspelt_option_names_kvclient():
    """API.md names `PermissionDeniedError` and `AuthError` for the admin calls: importable
    from `kvstore` as the other errors are; a misspelt client option names the class the
    caller wrote, not `AsyncKVClient.__init__()`."""
    import torch

    from kvstore import AuthError, KVLayout, KVStoreError, PermissionDeniedError
    from kvstore.client import KVClient

    assert issubclass(AuthError, KVStoreError) and issubclass(PermissionDeniedError, KVStoreError)
    layout = KVLayout(model="m", num_layers=1, num_kv_heads=1, head_dim=8,
                      dtype=torch.float16, block_tokens=16)
    with pytest.raises(TypeError, match=r"^KVClient\(\) got an unexpected keyword argument "
                                        r"'deadlin_s'"):
        KVClient("unix:///nonexistent.sock", layout, deadlin_s=1.0)
