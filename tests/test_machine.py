"""c2jax.machine: what benchmarks record about the machine they measured on."""

from c2jax.machine import describe, finish, parse_cpuinfo, summary_line

_FLAGS_AVX2 = "fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2"
_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: {family}
model\t\t: {model}
model name\t: AMD EPYC
flags\t\t: {flags}

processor\t: 1
vendor_id\t: AuthenticAMD
flags\t\t: fpu
"""
_ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics sve
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


def test_isa_level_from_flags():
    zen1 = parse_cpuinfo(_EPYC.format(family=23, model=1, flags=_FLAGS_AVX2))
    assert zen1["simd"] == "AVX2"
    assert (zen1["cpu_model"], zen1["cpu_family"], zen1["cpu_model_number"]) == ("AMD EPYC", "23", "1")
    zen4 = parse_cpuinfo(_EPYC.format(family=25, model=17, flags=_FLAGS_AVX2 + " avx512f avx512dq avx512bw"))
    assert zen4["simd"] == "AVX-512" and zen4["cpu_family"] == "25"
    assert parse_cpuinfo(_EPYC.format(family=21, model=2, flags="sse sse2 avx"))["simd"] == "AVX"
    assert parse_cpuinfo(_EPYC.format(family=16, model=2, flags="sse sse2"))["simd"] == "none"
    assert parse_cpuinfo("")["simd"] == "unknown"  # x86 without /proc/cpuinfo (macOS)


def test_non_x86_reports_the_architecture():
    arm = parse_cpuinfo(_ARM, arch="aarch64")
    assert arm["simd"] == "aarch64"
    assert arm["cpu_family"] is None
    assert parse_cpuinfo("", arch="arm64")["simd"] == "arm64"


def test_describe_and_summary_line():
    m = describe()
    for key in ("cpu_model", "simd", "arch", "logical_cores", "affinity_cores", "memory_gib", "load_avg_start",
                "python", "jax", "jaxlib"):
        assert key in m, key
    assert m["cpu_model"] and m["logical_cores"] >= 1
    line = summary_line(m)
    assert f"{m['logical_cores']} cores" in line and m["simd"] in line
    load = m["load_avg_start"]
    if load is not None:
        assert "load " + "/".join(f"{x:.2f}" for x in load) in line
    finish(m)
    assert "load_avg_end" in m and "at end" in summary_line(m)


def test_summary_line_format():
    m = {"cpu_model": "AMD EPYC", "cpu_family": "23", "cpu_model_number": "1", "simd": "AVX2",
         "logical_cores": 2, "affinity_cores": 2, "memory_gib": 15.6, "load_avg_start": [0.31, 0.25, 0.1]}
    assert summary_line(m) == "AMD EPYC (family 23 model 1, AVX2), 2 cores, 15.6 GiB, load 0.31/0.25/0.10"
