"""benchmarks/cpu_accounting.py: the /proc parsers and the CPU-seconds arithmetic that flag a benchmark cell run
beside other load, on hand-written /proc text."""

import pytest

from script_module import load_script


@pytest.fixture(scope="module")
def cpu():
    return load_script("benchmarks/cpu_accounting.py", "cpu_accounting")


# pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
STAT = "4242 (VLLM::Engine Core) (x)) S 4200 4200 4200 0 -1 4194560 100 0 0 0 700 50 20 5 20 0 3 0"


def test_a_pid_stat_line_with_spaces_and_parentheses_in_its_name(cpu):
    assert cpu.parse_pid_stat(STAT) == {"pid": 4242, "ppid": 4200, "pgrp": 4200, "ticks": 700 + 50 + 20 + 5}
    with pytest.raises(ValueError, match="not a /proc"):
        cpu.parse_pid_stat("4242 S 1 1")


def test_proc_stat_busy_ticks_and_loadavg(cpu):
    text = "cpu  1000 20 300 5000 40 6 7 8 99 0\ncpu0 500 10 150 2500 20 3 3 4 0 0\nintr 1 2\n"
    assert cpu.parse_proc_stat(text) == 1000 + 20 + 300 + 6 + 7 + 8  # idle 5000, iowait 40, guest 99 left out
    with pytest.raises(ValueError, match="no aggregate"):
        cpu.parse_proc_stat("cpu0 1 2 3 4 5 6 7 8\n")
    assert cpu.parse_loadavg("1.52 0.80 0.33 3/253 15674\n") == [1.52, 0.80, 0.33]
    with pytest.raises(ValueError):
        cpu.parse_loadavg("1.0")


def test_ours_counts_each_group_and_the_caller_once(cpu):
    stats = [{"pid": 10, "ppid": 1, "pgrp": 10, "ticks": 100}, {"pid": 11, "ppid": 10, "pgrp": 10, "ticks": 30},
             {"pid": 20, "ppid": 10, "pgrp": 20, "ticks": 50}, {"pid": 21, "ppid": 20, "pgrp": 20, "ticks": 70},
             {"pid": 99, "ppid": 1, "pgrp": 99, "ticks": 1000}]
    assert cpu.ours_ticks(stats, {"trainer": 10, "server": 20}, own_pid=10) == {"trainer": 130, "server": 120}
    # a worker that does not lead its group (-1): only its own process counts as the trainer
    assert cpu.ours_ticks(stats, {"trainer": -1, "server": 20}, own_pid=10) == {"trainer": 100, "server": 120}


def test_cpu_usage_and_the_load_flag(cpu):
    start = {"t": 100.0, "hz": 100, "ours_ticks": {"trainer": 1000, "server": 500}, "busy_ticks": 10_000,
             "loadavg": [0.5, 0.4, 0.3]}
    end = {"t": 300.0, "hz": 100, "ours_ticks": {"trainer": 21_000, "server": 16_500}, "busy_ticks": 50_000,
           "loadavg": [2.1, 1.5, 0.9]}
    use = cpu.cpu_usage(start, end)
    # 200 s wall: trainer 200 s, server 160 s -> ours 360; busy 400 s -> foreign 40 s = 0.2 cores on average
    assert use == {"wall_s": 200.0, "cpu_s": {"trainer": 200.0, "server": 160.0}, "ours_cpu_s": 360.0,
                   "busy_cpu_s": 400.0, "foreign_cpu_s": 40.0, "foreign_cores": 0.2, "loadavg_start": [0.5, 0.4, 0.3],
                   "loadavg_end": [2.1, 1.5, 0.9]}
    assert cpu.load_flag(use, 0.10) == "other processes used 0.20 cores on average (> 0.1; load 0.5 -> 2.1)"
    assert cpu.load_flag(use, 0.25) is None and cpu.load_flag(None, 0.1) == "CPU use not recorded"
    # tick rounding can make ours exceed busy: foreign clamps at 0
    assert cpu.cpu_usage(start, {**end, "busy_ticks": 45_000})["foreign_cores"] == 0.0
    with pytest.raises(ValueError, match="later end"):
        cpu.cpu_usage(end, start)


def test_a_snapshot_reads_a_proc_tree(cpu, tmp_path):
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "stat").write_text(STAT)
    (tmp_path / "77").mkdir()  # a process that vanished: no stat file, skipped
    (tmp_path / "stat").write_text("cpu  1000 20 300 5000 40 6 7 8 0 0\n")
    (tmp_path / "loadavg").write_text("0.10 0.20 0.30 1/2 3\n")
    snap = cpu.snapshot({"server": 4200}, proc=tmp_path)
    assert snap["ours_ticks"]["server"] == 775 and snap["busy_ticks"] == 1341 and snap["loadavg"] == [0.1, 0.2, 0.3]
