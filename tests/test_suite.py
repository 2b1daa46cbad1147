"""The test suite's own behaviour: a failing shared fixture is reported once."""

import subprocess
import sys
import textwrap

from tests.conftest import REPO


def test_a_failing_module_fixture_is_one_error_and_its_other_users_are_skipped(tmp_path):
  (tmp_path / "test_cluster.py").write_text(
    textwrap.dedent(
      """
      import pytest

      @pytest.fixture(scope="module")
      def cluster():
        raise RuntimeError("the cluster was lost")

      def test_first(cluster): pass
      def test_second(cluster): pass
      def test_third(cluster): pass
      def test_unrelated(): pass
      """
    )
  )
  # its own basetemp: pytest's cleanup of old /tmp/pytest-of-* folders would walk into any
  # stalled FUSE mount another run left there (it hung 671 s once on a shared machine)
  inner = ["--basetemp", str(tmp_path / "basetemp"), str(tmp_path / "test_cluster.py")]
  out = subprocess.run(
    [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-rs", *inner],
    cwd=REPO,
    capture_output=True,
    text=True,
  ).stdout
  assert out.count("RuntimeError: the cluster was lost") == 1, out
  assert "1 passed, 2 skipped, 1 error" in out, out
  assert "the error at " in out and "test_cluster.py::test_first" in out, out
