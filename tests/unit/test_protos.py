import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_matches_protos():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "protogen.py"), "--check"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr


def test_every_wire_status_maps_to_an_exception():
    from kvpool.common.errors import KVPoolError, error_for_status, status_for_error
    from kvpool.protos.kvpool.v1 import master_pb2 as pb
    for name, code in pb.Status.items():
        err = error_for_status(code, "k")
        if code == pb.STATUS_OK:
            assert err is None
            continue
        assert isinstance(err, KVPoolError) and type(err) is not KVPoolError, name
        assert status_for_error(err) == code, name
