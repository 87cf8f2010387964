"""benchmarks/tools/prepare_peers.py: the peers' layout from their source trees (work trees and bare repositories),
causal_conv1d patched to build for sm_90 in float32 and bfloat16, on small stand-ins of the two repositories."""
import shutil
import subprocess
import zipfile

import pytest

from benchmarks.tools import prepare_peers

SETUP_PY = """cc_flag = []
cc_flag.append("-gencode")
cc_flag.append("arch=compute_80,code=sm_80")
if bare_metal_version >= Version("11.8"):
    cc_flag.append("-gencode")
    cc_flag.append("arch=compute_90,code=sm_90")

    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI is set to be the same as
    # torch._C._GLIBCXX_USE_CXX11_ABI
"""

DISPATCH_CPP = """#define DISPATCH_ITYPE_FLOAT_AND_HALF_AND_BF16(ITYPE, NAME, ...)                    \\
    if (ITYPE == at::ScalarType::Half) {                                            \\
        using input_t = at::Half;                                                   \\
        __VA_ARGS__();                                                              \\
    } else if (ITYPE == at::ScalarType::BFloat16) {                                 \\
        using input_t = at::BFloat16;                                               \\
        __VA_ARGS__();                                                              \\
    } else {                                                                        \\
        AT_ERROR(#NAME, " not implemented for input type '", toString(ITYPE), "'"); \\
    }

#define DISPATCH_WTYPE_FLOAT_AND_HALF_AND_BF16(WTYPE, NAME, ...)                     \\
    if (WTYPE == at::ScalarType::Half) {                                             \\
        using weight_t = at::Half;                                                   \\
        __VA_ARGS__();                                                               \\
    } else if (WTYPE == at::ScalarType::Float)  {                                    \\
        using weight_t = float;                                                      \\
        __VA_ARGS__();                                                               \\
    }
"""

KERNEL_CU = """template<typename input_t, typename weight_t>
void causal_conv1d_fwd_cuda(ConvParamsBase &params, cudaStream_t stream) {}

template void causal_conv1d_fwd_cuda<float, float>(ConvParamsBase &params, cudaStream_t stream);
template void causal_conv1d_fwd_cuda<at::Half, float>(ConvParamsBase &params, cudaStream_t stream);
template void causal_conv1d_fwd_cuda<at::BFloat16, at::Half>(ConvParamsBase &params, cudaStream_t stream);
template void causal_conv1d_fwd_cuda<at::BFloat16, at::BFloat16>(ConvParamsBase &params, cudaStream_t stream);
"""


def _write(root, files):
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def _mamba_tree(root):
    return _write(root, {
        "mamba_ssm/__init__.py": "import selective_scan_cuda\n",  # what the layout must not keep
        "mamba_ssm/ops/__init__.py": "import selective_scan_cuda\n",
        "mamba_ssm/ops/triton/__init__.py": "",
        "mamba_ssm/ops/triton/ssd_combined.py": "def mamba_chunk_scan_combined(): pass\n",
        "mamba_ssm/ops/selective_scan_interface.py": "import selective_scan_cuda\n",
        "mamba_ssm/utils/torch.py": "",
        "mamba_ssm/modules/__init__.py": "",
        "mamba_ssm/modules/mamba2.py": "class Mamba2: pass\n",
        "mamba_ssm/modules/mamba_simple.py": "",
        "mamba_ssm/distributed/tensor_parallel.py": "",
        "csrc/selective_scan/selective_scan.cpp": "",
    })


def _causal_conv1d_tree(root):
    return _write(root, {
        "causal_conv1d/__init__.py": "", "causal_conv1d/causal_conv1d_interface.py": "",
        "csrc/causal_conv1d.cpp": DISPATCH_CPP, "csrc/causal_conv1d_fwd.cu": KERNEL_CU, "csrc/static_switch.h": "",
        "setup.py": SETUP_PY, "pyproject.toml": "", "README.md": "", "LICENSE": "", "AUTHORS": "", "MANIFEST.in": "",
        "tests/test_causal_conv1d.py": "",
    })


def _bare_copy(tree, dest):
    """A bare repository whose HEAD holds `tree` (what the search tool's mirrors are)."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", str(tree)], check=True)
    subprocess.run([*git, "-C", str(tree), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(tree), "commit", "-q", "-m", "tree"], check=True)
    subprocess.run([*git, "clone", "-q", "--bare", str(tree), str(dest)], check=True)
    return dest


def _layout(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_same_layout_from_a_work_tree_and_from_a_bare_repository(tmp_path):
    mamba, conv = _mamba_tree(tmp_path / "mamba"), _causal_conv1d_tree(tmp_path / "conv")
    assert prepare_peers.main(["--mamba", str(mamba), "--causal-conv1d", str(conv), "--out", str(tmp_path / "a")]) == 0
    bare = [_bare_copy(mamba, tmp_path / "mamba.git"), _bare_copy(conv, tmp_path / "conv.git")]
    assert prepare_peers.main(["--mamba", str(bare[0]), "--causal-conv1d", str(bare[1]),
                               "--out", str(tmp_path / "b")]) == 0
    layout = _layout(tmp_path / "a")
    assert layout == _layout(tmp_path / "b")
    for path in layout:
        assert (tmp_path / "a" / path).read_bytes() == (tmp_path / "b" / path).read_bytes(), path
    assert layout == sorted([
        "cc/AUTHORS", "cc/LICENSE", "cc/MANIFEST.in", "cc/README.md", "cc/causal_conv1d/__init__.py",
        "cc/causal_conv1d/causal_conv1d_interface.py", "cc/csrc/causal_conv1d.cpp", "cc/csrc/causal_conv1d_fwd.cu",
        "cc/csrc/static_switch.h", "cc/pyproject.toml", "cc/setup.py",
        "mamba_ssm/__init__.py", "mamba_ssm/distributed/tensor_parallel.py", "mamba_ssm/modules/__init__.py",
        "mamba_ssm/modules/mamba2.py", "mamba_ssm/ops/__init__.py", "mamba_ssm/ops/triton/__init__.py",
        "mamba_ssm/ops/triton/ssd_combined.py", "mamba_ssm/utils/torch.py"])
    for package in prepare_peers.MAMBA_EMPTY_INITS:  # mamba_ssm's own imports its CUDA extensions
        assert (tmp_path / "a" / package / "__init__.py").read_text() == ""


def test_causal_conv1d_builds_for_sm90_in_float32_and_bfloat16(tmp_path):
    out = prepare_peers.prepare_causal_conv1d(_causal_conv1d_tree(tmp_path / "conv"), tmp_path / "peers")
    setup_py = (out / "setup.py").read_text()
    # The replacement comes after every append, so the build sees sm_90 alone.
    assert setup_py.index(prepare_peers.SM90_ONLY) > setup_py.rindex("cc_flag.append")
    assert setup_py.index(prepare_peers.SM90_ONLY) < setup_py.index("# HACK")
    dispatch = (out / "csrc" / "causal_conv1d.cpp").read_text()
    assert "Half" not in dispatch.replace("FLOAT_AND_HALF_AND_BF16", "")
    assert "if (ITYPE == at::ScalarType::BFloat16)" in dispatch and "if (WTYPE == at::ScalarType::Float)" in dispatch
    assert dispatch.count("__VA_ARGS__();") == 2
    kernels = (out / "csrc" / "causal_conv1d_fwd.cu").read_text()
    assert "at::Half" not in kernels
    assert kernels.count("template void") == 2 and "void causal_conv1d_fwd_cuda(ConvParamsBase" in kernels


def test_a_source_of_another_layout_is_refused_by_name(tmp_path):
    conv = _causal_conv1d_tree(tmp_path / "conv")
    (conv / "setup.py").write_text("cc_flag = []\n")
    with pytest.raises(ValueError, match="_GLIBCXX_USE_CXX11_ABI"):
        prepare_peers.prepare_causal_conv1d(conv, tmp_path / "peers")
    (conv / "csrc" / "causal_conv1d.cpp").write_text("// no dispatch\n")
    with pytest.raises(ValueError, match="float16 branch"):
        prepare_peers.without_half_dispatch((conv / "csrc" / "causal_conv1d.cpp").read_text())
    with pytest.raises(FileNotFoundError, match="mamba_ssm/modules/mamba2.py"):
        prepare_peers.prepare_mamba(_write(tmp_path / "mamba", {"mamba_ssm/ops/triton/a.py": "",
                                                                 "mamba_ssm/utils/b.py": "",
                                                                 "mamba_ssm/distributed/c.py": ""}),
                                    tmp_path / "peers")


def test_the_jla_package_of_a_wheel(tmp_path):
    wheel = tmp_path / "jax_linear_attention-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("jla/__init__.py", "")
        archive.writestr("jla/ops.py", "def linear_attention(): pass\n")
        archive.writestr("jax_linear_attention-0.1.0.dist-info/METADATA", "")
    assert prepare_peers.main(["--jla-wheel", str(wheel), "--out", str(tmp_path / "peers")]) == 0
    assert _layout(tmp_path / "peers") == ["jla/__init__.py", "jla/ops.py"]


def test_the_command_line_names_what_is_missing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prepare_peers.main(["--out", str(tmp_path)])
    assert "name at least one peer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare_peers.main(["--mamba", str(tmp_path / "nowhere")])
    error = capsys.readouterr().err
    assert "--mamba" in error and "nowhere: no such file or folder" in error
