"Execute every notebook in nbs/ (the library's source and docs) as one pytest case each, skipping flagged cells."
from pathlib import Path
import pytest
import nbdev.test as nbt

NBS = Path(__file__).parents[1]/'nbs'
SKIP_FLAGS = ['slow', 'cuda', 'v1']  # settings.ini/pyproject tst_flags: heavy, GPU-only and fastai-v1-only cells

@pytest.mark.parametrize('nb', sorted(p.name for p in NBS.glob('*.ipynb')), ids=lambda n: n)
def test_notebook(nb):
    ok, secs = nbt.test_nb(NBS/nb, skip_flags=SKIP_FLAGS, showerr=True)
    assert ok, f'{nb} failed (traceback above)'
