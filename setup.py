"""pip install --no-build-isolation . : builds ferry's Python module with CMake.

With FERRY_BUILD_DIR set (an already configured build tree, such as build/release), the module
is built there; otherwise a build tree is configured in build/pip for the interpreter running
pip. Nothing is downloaded. docs/python.md.
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build = os.environ.get("FERRY_BUILD_DIR")
        if build:
            build = os.path.abspath(build)
        else:
            build = os.path.join(HERE, "build", "pip")
            subprocess.check_call(
                ["cmake", "-S", HERE, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DFERRY_BUILD_TESTS=OFF", f"-DFERRY_PYTHON_EXECUTABLE={sys.executable}"])
        subprocess.check_call(["cmake", "--build", build, "--target", "ferry_python"])
        built = glob.glob(os.path.join(build, "python", "ferry", "_native*.so"))
        if not built:
            raise RuntimeError(f"no ferry/_native*.so in {build}/python: is pybind11-dev there?")
        dest = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy(built[0], dest)


setup(
    name="ferry",
    version="0.1.0",
    description="ferry's transfer engine for disaggregated LLM serving, from Python",
    python_requires=">=3.8",
    packages=["ferry"],
    package_dir={"": "python"},
    package_data={"ferry": ["*.pyi", "py.typed"]},
    ext_modules=[Extension("ferry._native", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
