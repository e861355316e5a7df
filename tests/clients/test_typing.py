"""The SDK as an application sees it once installed: typed for the application's own `mypy --strict`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

USER_CODE = """
    import asyncio

    from adaptlm_client import AdaptlmError, AsyncClient, Client, GenerateDone, NotFoundError, RetryPolicy, Session

    def app() -> float:
        with Client("http://127.0.0.1:8000", timeout=60, retry=RetryPolicy(max_retries=3)) as client:
            bpb: float = client.score("It is a truth").bits_per_byte or 0.0  # None: nothing scored (a word held back)
            with client.generate_stream("It was a dark", max_tokens=10) as stream:
                for chunk in stream:
                    bpb += len(chunk)
            done: GenerateDone = stream.result
            session: Session = client.create_session(initial_text="Dear Sir,")
            words: list[str] = [w.text for w in session.suggest("tomor").completions]
            blob: bytes = session.export()
            try:
                client.import_state("my-saved-session-0001", blob)
            except NotFoundError as e:
                status: int | None = e.status
                retry_after: float | None = e.retry_after
                return float(status or 0) + (retry_after or 0.0)
            except AdaptlmError as e:
                request_id: str | None = e.request_id
                return float(len(request_id or ""))
            return bpb + done.usage.total_tokens + len(words)

    class AppClient(Client):  # an application's own client: the context manager gives it back, not a Client
        def bits(self, text: str) -> float:
            return self.score(text).bits

    class AppAsyncClient(AsyncClient):
        async def bits(self, text: str) -> float:
            return (await self.score(text)).bits

    def subclassed() -> float:
        with AppClient() as client:
            return client.bits("x")

    async def async_subclassed() -> float:
        async with AppAsyncClient() as client:
            return await client.bits("x")

    async def async_app() -> float:
        async with AsyncClient("http://127.0.0.1:8000") as client:
            a, b = await asyncio.gather(client.score("a"), client.score("b"))
            return (a.bits_per_byte or 0.0) + (b.bits_per_byte or 0.0)
"""


def test_mypy_strict_accepts_user_code_against_the_installed_sdk(tmp_path: Path) -> None:
    # An installed SDK is laid out in site-packages as a wheel installs it; mypy reads such a package's types only
    # when it carries PEP 561's `py.typed` (else: "module is installed, but missing library stubs or py.typed
    # marker", and every answer is Any). Its dependencies (httpx, pydantic) come from this environment by a .pth.
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    shutil.copytree(ROOT / "clients" / "adaptlm_client", site / "adaptlm_client",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    user = tmp_path / "app.py"
    user.write_text(textwrap.dedent(USER_CODE))
    # mypy's incremental cache kept between runs (beside the one `mypy server clients` keeps, git-ignored): a module
    # is taken from it only when its text hashes the same (the copies here are new files each run), so httpx and
    # pydantic are analysed once and not on every run; a cached module's errors are reported again
    cache = ROOT / ".mypy_cache" / "sdk-user-code"
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--python-executable", str(python), "--cache-dir",
                        str(cache), str(user)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
