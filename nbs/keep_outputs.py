"""`python keep_outputs.py NOTEBOOK...` (run in nbs/): run each notebook's cells as `nbdev-test` does (cells flagged
`#| slow`, `#| cuda` or `#| v1` skipped) and keep the outputs of the cells whose first line is `# output kept`: the
pre-flight lines, tables and plots a reader should see on GitHub. Every other cell is left without outputs. Run
`nbdev-clean` after it."""
import json, sys
from pathlib import Path
from execnb.shell import CaptureShell

SKIP = ('#| slow', '#| cuda', '#| v1', '#| eval: false', '#| eval:false')
MARK = '# output kept'

def keep_outputs(path:str):
    "Run notebook `path`, storing the outputs of its `# output kept` cells; raises if a cell fails."
    nb = json.loads(Path(path).read_text())
    shell = CaptureShell(path=Path(path).parent)
    for cell in nb['cells']:
        if cell['cell_type'] != 'code': continue
        src = ''.join(cell['source'])
        cell['outputs'], cell['execution_count'] = [], None
        if any(line.strip() in SKIP for line in src.splitlines()): continue
        outputs = shell.run(src)
        if shell.exc: raise RuntimeError(f"{path}: cell {cell.get('id')} failed") from shell.exc
        if src.startswith(MARK): cell["outputs"] = [dict(o) for o in outputs]
    Path(path).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')

if __name__ == '__main__':
    for p in sys.argv[1:]: keep_outputs(p)
