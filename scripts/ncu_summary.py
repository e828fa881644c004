"""Summarise `ncu --csv --page raw` output: achieved DRAM bandwidth per kernel launch."""
import csv
import sys


def number(text):
    return float(text.replace(",", "")) if text else 0.0


def main(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # drop the program's own output
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        print("no kernel rows in", path)
        return
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}

    def unit_scale(name):
        u = units[col[name]]
        return {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1e-9,
                "usecond": 1e-6, "msecond": 1e-3, "second": 1.0, "ns": 1e-9, "us": 1e-6,
                "ms": 1e-3, "s": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9}.get(u, 1.0)

    print(f"{'kernel':<22} {'grid':>5} {'regs':>5} {'time us':>9} {'read MB':>9} {'write MB':>9} "
          f"{'GB/s':>7} {'% peak':>7}")
    for r in data:
        t = number(r[col["gpu__time_duration.sum"]]) * unit_scale("gpu__time_duration.sum")
        rd = number(r[col["dram__bytes_read.sum"]]) * unit_scale("dram__bytes_read.sum")
        wr = number(r[col["dram__bytes_write.sum"]]) * unit_scale("dram__bytes_write.sum")
        pct = number(r[col["dram__throughput.avg.pct_of_peak_sustained_elapsed"]])
        name = r[col["Kernel Name"]] if "Kernel Name" in col else "?"
        grid = r[col["launch__grid_size"]]
        regs = r[col["launch__registers_per_thread"]]
        gbs = (rd + wr) / t / 1e9 if t else 0.0
        print(f"{name:<22} {grid:>5} {regs:>5} {t * 1e6:9.1f} {rd / 1e6:9.1f} {wr / 1e6:9.1f} "
              f"{gbs:7.0f} {pct:7.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
