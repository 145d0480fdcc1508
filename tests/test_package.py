"Packaging: version single-sourced, console script, public API."
import subprocess, sys
from configparser import ConfigParser
from pathlib import Path
import fastai_accum

ROOT = Path(__file__).parents[1]

def test_version_matches_settings():
    cfg = ConfigParser(); cfg.read(ROOT/'settings.ini')
    assert fastai_accum.__version__ == cfg['DEFAULT']['version']

def test_console_script_help_and_version():
    exe = str(Path(sys.executable).parent/'fastai-accum')  # installed by `pip install -e .`
    r = subprocess.run([exe, '--version'], capture_output=True, text=True)
    assert r.returncode == 0 and fastai_accum.__version__ in r.stdout
    r = subprocess.run([exe, '--help'], capture_output=True, text=True)
    assert r.returncode == 0 and 'fastai-accum' in r.stdout

def test_all_exports_public_api():
    import fastai_accum.all as a
    for name in ['ChannelStats', 'AccumulateBatchNorm', 'wrap_bn', 'unwrap_bn', 'update_bn_stats']:
        assert name in a.__all__ and hasattr(a, name)

def test_ci_runs_the_readme_test_command():
    readme, ci = (ROOT/'README.md').read_text(), (ROOT/'.ci/run').read_text()
    cmd = next(l for l in readme.splitlines() if 'pytest' in l and l.startswith('python3 -m venv'))
    assert cmd in ci.splitlines()
