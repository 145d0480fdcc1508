"Package metadata comes from settings.ini (nbdev convention); this file only translates it for setuptools."
from configparser import ConfigParser
from pathlib import Path
import setuptools

here = Path(__file__).parent
config = ConfigParser(delimiters=['='])
config.read(here/'settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.9 3.10 3.11 3.12 3.13'.split()
lic = licenses[cfg['license']]
min_python = cfg['min_python']

setuptools.setup(
    name=cfg['lib_name'].replace('_', '-'),
    version=cfg['version'],
    description=cfg['description'],
    long_description=(here/'README.md').read_text(encoding='utf-8'),
    long_description_content_type='text/markdown',
    author=cfg['author'], author_email=cfg['author_email'],
    url=cfg['git_url'],
    license=lic[0],
    keywords=cfg['keywords'].split(),
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])],
                 'Intended Audience :: ' + cfg['audience'].title(),
                 'Natural Language :: ' + cfg['language'].title(),
                 'License :: ' + lic[1]] +
                ['Programming Language :: Python :: ' + v for v in py_versions[py_versions.index(min_python):]],
    packages=setuptools.find_packages(include=[cfg['lib_name'], cfg['lib_name'] + '.*']),
    include_package_data=True,
    python_requires='>=' + min_python,
    install_requires=cfg['requirements'].split(),
    # every `<name>_requirements` key of settings.ini is an extra: [dev], [timm]
    extras_require={k[:-len('_requirements')]: v.split() for k, v in cfg.items() if k.endswith('_requirements') and k != 'requirements'},
    entry_points={'console_scripts': cfg['console_scripts'].split(),
                  'nbdev': [f"{cfg['lib_name']}={cfg['lib_name']}._modidx:d"]},
    zip_safe=False,
)
