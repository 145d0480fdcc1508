"The tests' layout: no module in tests/ imports a test module; what they share lives in tests/helpers.py (or dist_helpers.py)."
import ast
from pathlib import Path

TESTS = Path(__file__).parent

def _is_test_module(name): return name is not None and name.split('.')[0].startswith('test_')

def imported_test_modules(source:str) -> list:
    "The test modules `source` imports, at any nesting level: `import test_x`, `from test_x import y`, `from .test_x import y`."
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import): hits += [a.name for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if _is_test_module(node.module): hits.append(node.module)
            elif node.module is None: hits += [a.name for a in node.names if _is_test_module(a.name)]  # from . import test_x
    return hits

def test_no_test_module_imports_another():
    "Each shared helper has one home outside the test modules, so a test module runs (and is read) on its own."
    found = {p.name: hits for p in sorted(TESTS.glob('*.py')) if (hits := imported_test_modules(p.read_text()))}
    assert not found, f'test modules imported (move what they share to tests/helpers.py): {found}'

SNIPPET = '''
import os, test_callback
import test_exact as te
from test_exact_or_says_so import forced_budget as budget
from helpers import make_learner
from fastai_accum.helpers import emulated_accelerator
import testing, pytest_timeout
from . import test_ghost
from .test_plan import bn_net
class Fixture:
    def method(self):
        if True:
            try: from test_messages import fit
            except ImportError: pass
def test_inside():
    def inner():
        import test_core.sub
'''

def test_the_scanner_finds_test_module_imports_at_any_depth():
    "Not blind: a snippet with test-module imports at module level, in a class's method, in a nested function, relative ones, among others."
    assert sorted(imported_test_modules(SNIPPET)) == ['test_callback', 'test_core.sub', 'test_exact', 'test_exact_or_says_so',
                                                      'test_ghost', 'test_messages', 'test_plan']
    assert imported_test_modules('from helpers import make_learner\nimport dist_helpers\nfrom fastai_accum.helpers import can_pin') == []
