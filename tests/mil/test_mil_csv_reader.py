"""read_mil_csv on awkward files: pandas' numbered header, binary or oversized content, a non-numeric
field (each one clear ConfigError naming the file), and the header rule shared with the MNIST CSV reader."""

from __future__ import annotations

import pytest

from wsi_milssl.errors import ConfigError
from wsi_milssl.mil.data import is_csv_header, read_mil_csv

ROWS = "1,a,0.5,0.25\n0,a,0.0,0.5\n0,b,1.5,2.0\n"


@pytest.mark.parametrize("header", ["0,1,2,3\n", '"0","1","2","3"\n', "label,bag,f1,f2\n", ""])
def test_a_header_row_is_not_an_instance(tmp_path, header):
    # pandas' to_csv(index=False) of a frame without column names writes the column numbers as header
    path = tmp_path / "bags.csv"
    path.write_text(header + ROWS)
    inst = read_mil_csv(path)
    assert len(inst) == 3 and inst.bag_names == ["a", "b"] and inst.bag_labels.tolist() == [1, 0]


def test_the_header_rule():
    assert is_csv_header(["label", "bag", "f1"]) and is_csv_header(["0", "1", "2"]) and is_csv_header([])
    # numbers that are data: scientific notation, signs, column numbers out of order or not from 0
    for row in (["1e2", "3"], ["-0.5", "x"], ["0", "2", "1"], ["1", "2", "3"], ["0", "1", "2.5"]):
        assert not is_csv_header(row), row


def test_a_binary_file_is_one_clear_error(tmp_path):
    path = tmp_path / "image.csv"
    path.write_bytes(b"1,a,0.5\n" + bytes(range(128, 256)))
    with pytest.raises(ConfigError, match=r"image\.csv: not a text CSV \(byte \d+ is not UTF-8\)"):
        read_mil_csv(path)


def test_a_field_beyond_the_csv_limit_is_one_clear_error(tmp_path):
    path = tmp_path / "huge.csv"
    path.write_text("1,a," + "1" * 200_000 + "\n")
    with pytest.raises(ConfigError, match=r"huge\.csv: cannot read the MIL CSV \(field larger than field limit"):
        read_mil_csv(path)


def test_a_non_numeric_field_names_its_row(tmp_path):
    path = tmp_path / "typo.csv"
    path.write_text("label,bag,f1\n1,a,0.5\n0,b,0.x\n")
    with pytest.raises(ConfigError, match=r"typo\.csv: non-numeric label or feature on line 3: .*'0\.x'"):
        read_mil_csv(path)


def test_a_utf8_byte_order_mark_is_not_a_header(tmp_path):
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + ROWS.encode())
    assert len(read_mil_csv(path)) == 3


def test_messages_name_the_file_line_and_a_minus_one_label_gets_the_fix(tmp_path):
    """A ragged row was "row 4" for file line 5 under a header (other messages counted data rows); -1/1
    labels were refused without saying how to fix them."""
    path = tmp_path / "ragged.csv"
    path.write_text("label,bag,f1\n1,a,0.5\n\n0,b,0.1\n0,b,0.1,0.2\n")
    with pytest.raises(ConfigError, match=r"ragged\.csv: line 5 has 4 columns, expected 3 \(as line 2\)"):
        read_mil_csv(path)
    path = tmp_path / "data dir" / "signed.csv"
    path.parent.mkdir()
    path.write_text('label,bag,f1\n1,a,0.5\n-1,b,0.1\n"-1",c,0.2\n -1.0 ,d,0.3\n')
    with pytest.raises(ConfigError, match=r"signed\.csv: labels \(first column\) must be 0 or 1; found \[-1\.0, 1\.0\] "
                                          r"\(first on line 3\)\. A -1/1 file .* needs -1 mapped to 0 first, e\.g\. "
                                          r"`sed -E ") as err:
        read_mil_csv(path)
    # the command it gives works as pasted, from any folder (review CD: the file's name alone, and '-1,' alone)
    import subprocess

    command = str(err.value).split("e.g. `", 1)[1].split("`", 1)[0]
    subprocess.run(["bash", "-c", command], cwd="/", check=True)
    fixed = read_mil_csv(tmp_path / "data dir" / "signed_01.csv")
    assert fixed.bag_labels.tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("sep, name", [("\t", "tabs"), (";", "semicolons")])
def test_a_file_separated_otherwise_than_by_commas_is_named_so(tmp_path, sep, name):
    """Review CD: such a file was "got 1 columns (line 2)", with no word on the separator."""
    path = tmp_path / "bags.csv"
    path.write_text(sep.join(["0", "a", "0.1", "0.2"]) + "\n" + sep.join(["1", "b", "0.3", "0.1"]) + "\n")
    with pytest.raises(ConfigError, match=rf"got 1 columns \(line \d\)\. The values look separated by {name}: write "
                                          r"the file comma-separated, with decimal points\."):
        read_mil_csv(path)


def test_a_semicolon_file_with_decimal_commas_is_named_so(tmp_path):
    """Review CF: a European spreadsheet's export (0;a;0,1;0,2) splits on its decimal commas into three columns and
    failed on the number with no word on the separator."""
    path = tmp_path / "bags.csv"
    path.write_text("0;a;0,1;0,2\n1;b;0,3;0,1\n")
    # review EH: its first row was taken for a header, so the error named line 2
    with pytest.raises(ConfigError, match=r"separated by commas; line 1 reads '0;a;0,1;0,2'\. The values look "
                                          r"separated by semicolons: write the file comma-separated, with decimal "
                                          r"points\."):
        read_mil_csv(path)
