"The staged step's modules read as a schedule and a loop: each class in one place, state written by its owner, short functions and cells."
import ast, json, re
from pathlib import Path
import fastai_accum

PKG = Path(fastai_accum.__file__).parent
STAGED = ['staged', 'stage_cut', 'probes', 'window_store', 'chunk_sizer', 'remade', 'schedule', 'window_stats', 'link',
          'staged_exact', 'staged_check']
MUTATORS = {'append', 'add', 'pop', 'update', 'setdefault', 'clear', 'extend', 'remove', 'insert', 'discard', 'popitem'}

def _patched_class(f:ast.FunctionDef) -> str|None:
    "The class a `@patch` function is added to (its first argument's annotation), else None."
    patched = any((isinstance(d, ast.Name) and d.id == 'patch') or (isinstance(d, ast.Call) and getattr(d.func, 'id', '') == 'patch')
                  for d in f.decorator_list)
    ann = f.args.args[0].annotation if patched and f.args.args else None
    return ann.id if isinstance(ann, ast.Name) else None

def owners(source:str) -> list:
    "Per top-level statement of a module, in order: the class it defines or patches, else None."
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef): out.append(node.name)
        elif isinstance(node, ast.FunctionDef): out.append(_patched_class(node))
        else: out.append(None)
    return out

def interleaved(source:str) -> list:
    "[(class, other class)] where another class or its methods come between a class and its last `@patch` method."
    seq, found = owners(source), []
    for cls in {c for c in seq if c is not None}:
        at = [i for i, c in enumerate(seq) if c == cls]
        found += [(cls, c) for c in dict.fromkeys(seq[at[0]:at[-1] + 1]) if c not in (None, cls)]
    return found

def _root(node) -> tuple:
    "(the name an attribute chain starts from, how many attributes deep), or (None, 0)."
    depth = 0
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        depth += isinstance(node, ast.Attribute)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), depth

def _foreign(target, allowed=('self',)) -> bool:
    "Does writing `target` write another object's state: an attribute of a name other than `self`, or of `self`'s parts?"
    if not isinstance(target, (ast.Attribute, ast.Subscript)): return False
    if isinstance(target, ast.Attribute) and target.attr == 'grad': return False  # a parameter's gradient: torch's API
    name, depth = _root(target)
    if depth == 0: return False  # a local dict or list
    return name not in allowed or depth > 1

def foreign_writes(source:str) -> list:
    "['function: line'] where a method (or a `@patch` function) writes another object's attributes, or mutates them in place."
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or not node.args.args: continue
        first = node.args.args[0].arg
        if first not in ('self', 'ctx'): continue
        for sub in ast.walk(node):
            targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, (ast.AugAssign, ast.AnnAssign)) else []
            targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            calls = [sub.func.value] if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                                         and sub.func.attr in MUTATORS and isinstance(sub.func.value, ast.Attribute)) else []
            for t in targets + calls:
                if _foreign(t, (first,)): found.append(f'{node.name}: {ast.unparse(t)} (line {sub.lineno})')
    return found

def long_functions(source:str, most:int=40) -> list:
    return [f'{n.name} ({n.end_lineno - n.lineno + 1} lines)' for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > most]

def long_cells(source:str, most:int=60) -> list:
    "The exported cells (`# %%` sections of a generated module) of more than `most` lines."
    cells = re.split(r'\n(?=# %% )', source)
    return [c.splitlines()[0] + f' ({len(c.splitlines()) - 1} lines)' for c in cells[1:] if len(c.rstrip().splitlines()) - 1 > most]

def test_each_staged_class_is_read_in_one_place():
    "In every staged module, a class's `@patch` methods follow it with no other class or its methods between."
    found = {m: got for m in STAGED if (got := interleaved((PKG / f'{m}.py').read_text()))}
    assert not found, found

def test_state_is_written_only_by_its_owner():
    "No method of a staged module assigns another object's attributes or mutates them in place (`x.a = ...`, `self.a.b[k] = ...`, `w.a.append(...)`)."
    found = {m: got for m in STAGED if (got := foreign_writes((PKG / f'{m}.py').read_text()))}
    assert not found, found

def test_staged_functions_and_cells_are_short():
    "No function of a staged module over 40 lines, no exported cell over 60, `staged_exact.py` within 700 lines."
    for m in STAGED:
        text = (PKG / f'{m}.py').read_text()
        assert not long_functions(text), (m, long_functions(text))
        assert not long_cells(text), (m, long_cells(text))
    assert len((PKG / 'staged_exact.py').read_text().splitlines()) <= 700

STEP_WRITE = re.compile(r'^.*\bstep(?:_for\(.*?\))?\.[\w.]+\s*(?:\[[^\]]*\])?\s*=(?!=).*$', re.M)

def step_writes(text:str) -> list:
    "The lines assigning an attribute of a staged step, or of its parts or configuration, from outside it (`f.step.config.grow = ...`)."
    return [m.group(0).strip() for m in STEP_WRITE.finditer(text)]

def _code(f:Path) -> str:
    "A module's text, or a notebook's code cells joined."
    if f.suffix != '.ipynb': return f.read_text()
    return '\n'.join(''.join(c['source']) for c in json.loads(f.read_text())['cells'] if c['cell_type'] == 'code')

def test_outside_code_reaches_a_step_through_its_seams():
    "Tests, benchmarks and the library change a step only through `StagedConfig.set`, `StagedStep.hooked` and `forget_window`."
    files = [*PKG.rglob('*.py'), *Path(__file__).parent.glob('*.py'), *(PKG.parent / 'nbs').glob('*.ipynb')]
    found = {f.name: got for f in files if f != Path(__file__) and (got := step_writes(_code(f)))}  # not this file's examples
    assert not found, found
    assert step_writes("f.step.config.grow, f.step.config.local = False, True\nx = f.step_for((x,)).window\n"
                       "f.step_for((x,)).config.grow = False\nf.step.config.set(grow=False)\nif f.step.window == w: pass") == [
        'f.step.config.grow, f.step.config.local = False, True', 'f.step_for((x,)).config.grow = False']

SNIPPET = '''
# %% a
class A:
    def __init__(self, b): self.b, self.n = b, 0
    def run(self, w):
        w.spans = []
        self.b.costs[1] = 2
        self.b.seen.add(3)
        w.random.append(1)
        self.n += 1
        local = {}; local[1] = 2
        p.grad = None
class B: pass
@patch
def more(self:A): self.items = []
# %% b
def helper(): pass
@patch
def other(self:B): pass
'''

def test_the_checks_are_not_blind():
    "On a snippet with each fault: A and B interleaved, four foreign writes, a cell and a function over their limits."
    assert sorted(interleaved(SNIPPET)) == [('A', 'B'), ('B', 'A')]  # each between the other and its last method
    got = foreign_writes(SNIPPET)
    assert [g.split(' (')[0] for g in got] == ['run: w.spans', 'run: self.b.costs[1]', 'run: self.b.seen', 'run: w.random'], got
    assert long_cells(SNIPPET, most=5) == ['# %% a (13 lines)']
    assert long_functions(SNIPPET, most=7) == ['run (8 lines)']
