"""A ``cluster`` test that skips itself, which ``test_catalog_cluster.py`` runs in a child pytest
to watch the conftest rule: a skip fails under a forced ``DMI_LIVE_SERVER``.

Not collected by a plain ``pytest`` run (the name does not match ``test_*.py``).
"""

import pytest


@pytest.mark.cluster
def test_skips_itself():
    pytest.skip("on purpose")
