#include "core/msgpack.h"

#include <fmt/core.h>

#include <cstring>

namespace ferry {

void MsgpackWriter::Nil() { out_.push_back(char(0xc0)); }

void MsgpackWriter::Uint(uint64_t v) {
    if (v < 128) {
        out_.push_back(char(v));
    } else if (v <= 0xff) {
        out_.push_back(char(0xcc));
        Be(v, 1);
    } else if (v <= 0xffff) {
        out_.push_back(char(0xcd));
        Be(v, 2);
    } else if (v <= 0xffffffffull) {
        out_.push_back(char(0xce));
        Be(v, 4);
    } else {
        out_.push_back(char(0xcf));
        Be(v, 8);
    }
}

void MsgpackWriter::Int(int64_t v) {
    if (v >= 0) return Uint(uint64_t(v));
    if (v >= -32) {
        out_.push_back(char(int8_t(v)));
    } else if (v >= INT8_MIN) {
        out_.push_back(char(0xd0));
        Be(uint64_t(v), 1);
    } else if (v >= INT16_MIN) {
        out_.push_back(char(0xd1));
        Be(uint64_t(v), 2);
    } else if (v >= INT32_MIN) {
        out_.push_back(char(0xd2));
        Be(uint64_t(v), 4);
    } else {
        out_.push_back(char(0xd3));
        Be(uint64_t(v), 8);
    }
}

void MsgpackWriter::Float(double v) {
    out_.push_back(char(0xcb));
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    Be(bits, 8);
}

void MsgpackWriter::Str(std::string_view s) {
    if (s.size() < 32) {
        out_.push_back(char(0xa0 | s.size()));
    } else if (s.size() <= 0xff) {
        out_.push_back(char(0xd9));
        Be(s.size(), 1);
    } else if (s.size() <= 0xffff) {
        out_.push_back(char(0xda));
        Be(s.size(), 2);
    } else {
        out_.push_back(char(0xdb));
        Be(s.size(), 4);
    }
    out_.append(s);
}

void MsgpackWriter::Bin(const uint8_t* p, size_t n) {
    if (n <= 0xff) {
        out_.push_back(char(0xc4));
        Be(n, 1);
    } else if (n <= 0xffff) {
        out_.push_back(char(0xc5));
        Be(n, 2);
    } else {
        out_.push_back(char(0xc6));
        Be(n, 4);
    }
    out_.append(reinterpret_cast<const char*>(p), n);
}

void MsgpackWriter::Array(size_t n) { Header(n, 0x90, 0xdc, 0xdd); }
void MsgpackWriter::Map(size_t n) { Header(n, 0x80, 0xde, 0xdf); }

void MsgpackWriter::Header(size_t n, uint8_t fix, uint8_t b16, uint8_t b32) {
    if (n < 16) {
        out_.push_back(char(fix | n));
    } else if (n <= 0xffff) {
        out_.push_back(char(b16));
        Be(n, 2);
    } else {
        out_.push_back(char(b32));
        Be(n, 4);
    }
}

void MsgpackWriter::Be(uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) out_.push_back(char((v >> (8 * i)) & 0xff));
}

Status MsgpackReader::Need(size_t n) const {
    if (data_.size() - pos_ < n) {
        return InvalidArgumentError(fmt::format("msgpack: {} bytes wanted at offset {}, {} left", n,
                                                pos_, data_.size() - pos_));
    }
    return Status::Ok();
}

Result<uint64_t> MsgpackReader::Be(size_t bytes) {
    FERRY_RETURN_IF_ERROR(Need(bytes));
    uint64_t v = 0;
    for (size_t i = 0; i < bytes; ++i) v = (v << 8) | uint8_t(data_[pos_ + i]);
    pos_ += bytes;
    return v;
}

Result<size_t> MsgpackReader::Length(size_t bytes) {
    FERRY_ASSIGN_OR_RETURN(uint64_t n, Be(bytes));
    return size_t(n);
}

Result<MsgpackReader::Type> MsgpackReader::Peek() const {
    FERRY_RETURN_IF_ERROR(Need(1));
    const uint8_t b = uint8_t(data_[pos_]);
    if (b <= 0x7f || b >= 0xe0) return Type::kInt;
    if ((b & 0xf0) == 0x80) return Type::kMap;
    if ((b & 0xf0) == 0x90) return Type::kArray;
    if ((b & 0xe0) == 0xa0) return Type::kStr;
    switch (b) {
        case 0xc0:
            return Type::kNil;
        case 0xc2:
        case 0xc3:
            return Type::kBool;
        case 0xc4:
        case 0xc5:
        case 0xc6:
            return Type::kBin;
        case 0xc7:
        case 0xc8:
        case 0xc9:
        case 0xd4:
        case 0xd5:
        case 0xd6:
        case 0xd7:
        case 0xd8:
            return Type::kExt;
        case 0xca:
        case 0xcb:
            return Type::kFloat;
        case 0xcc:
        case 0xcd:
        case 0xce:
        case 0xcf:
        case 0xd0:
        case 0xd1:
        case 0xd2:
        case 0xd3:
            return Type::kInt;
        case 0xd9:
        case 0xda:
        case 0xdb:
            return Type::kStr;
        case 0xdc:
        case 0xdd:
            return Type::kArray;
        case 0xde:
        case 0xdf:
            return Type::kMap;
    }
    return InvalidArgumentError(
        fmt::format("msgpack: reserved byte 0x{:02x} at offset {}", b, pos_));
}

Status MsgpackReader::ReadNil() {
    FERRY_ASSIGN_OR_RETURN(Type t, Peek());
    if (t != Type::kNil) {
        return InvalidArgumentError(fmt::format("msgpack: nil wanted at offset {}", pos_));
    }
    ++pos_;
    return Status::Ok();
}

Result<int64_t> MsgpackReader::ReadInt() {
    FERRY_RETURN_IF_ERROR(Need(1));
    const uint8_t b = uint8_t(data_[pos_]);
    if (b <= 0x7f) {
        ++pos_;
        return int64_t(b);
    }
    if (b >= 0xe0) {
        ++pos_;
        return int64_t(int8_t(b));
    }
    const size_t at = pos_;
    int bytes = 0;
    bool is_signed = false;
    switch (b) {
        case 0xcc:
            bytes = 1;
            break;
        case 0xcd:
            bytes = 2;
            break;
        case 0xce:
            bytes = 4;
            break;
        case 0xcf:
            bytes = 8;
            break;
        case 0xd0:
            bytes = 1;
            is_signed = true;
            break;
        case 0xd1:
            bytes = 2;
            is_signed = true;
            break;
        case 0xd2:
            bytes = 4;
            is_signed = true;
            break;
        case 0xd3:
            bytes = 8;
            is_signed = true;
            break;
        default:
            break;
    }
    if (bytes > 0) {
        ++pos_;
        FERRY_ASSIGN_OR_RETURN(uint64_t v, Be(size_t(bytes)));
        if (!is_signed) {
            if (v > uint64_t(INT64_MAX)) {
                return InvalidArgumentError(
                    fmt::format("msgpack: integer at offset {} out of range", at));
            }
            return int64_t(v);
        }
        const int shift = 64 - 8 * bytes;  // sign-extend
        return shift == 0 ? int64_t(v) : (int64_t(v << shift) >> shift);
    }
    return InvalidArgumentError(fmt::format("msgpack: integer wanted at offset {}", at));
}

Result<uint64_t> MsgpackReader::ReadUint() {
    FERRY_RETURN_IF_ERROR(Need(1));
    if (uint8_t(data_[pos_]) == 0xcf) {
        ++pos_;
        return Be(8);
    }
    const size_t at = pos_;
    FERRY_ASSIGN_OR_RETURN(int64_t v, ReadInt());
    if (v < 0) {
        return InvalidArgumentError(fmt::format("msgpack: negative integer at offset {}", at));
    }
    return uint64_t(v);
}

Result<double> MsgpackReader::ReadNumber() {
    FERRY_ASSIGN_OR_RETURN(Type t, Peek());
    if (t == Type::kInt) {
        FERRY_ASSIGN_OR_RETURN(int64_t v, ReadInt());
        return double(v);
    }
    if (t != Type::kFloat) {
        return InvalidArgumentError(fmt::format("msgpack: number wanted at offset {}", pos_));
    }
    const uint8_t b = uint8_t(data_[pos_++]);
    if (b == 0xca) {
        FERRY_ASSIGN_OR_RETURN(uint64_t bits, Be(4));
        uint32_t u = uint32_t(bits);
        float f;
        std::memcpy(&f, &u, sizeof f);
        return double(f);
    }
    FERRY_ASSIGN_OR_RETURN(uint64_t bits, Be(8));
    double d;
    std::memcpy(&d, &bits, sizeof d);
    return d;
}

Result<std::string_view> MsgpackReader::ReadStr() {
    FERRY_RETURN_IF_ERROR(Need(1));
    const size_t at = pos_;
    const uint8_t b = uint8_t(data_[pos_]);
    size_t n = 0;
    if ((b & 0xe0) == 0xa0) {
        n = b & 0x1f;
        ++pos_;
    } else if (b >= 0xd9 && b <= 0xdb) {
        ++pos_;
        FERRY_ASSIGN_OR_RETURN(n, Length(size_t(1) << (b - 0xd9)));
    } else {
        return InvalidArgumentError(fmt::format("msgpack: string wanted at offset {}", at));
    }
    FERRY_RETURN_IF_ERROR(Need(n));
    std::string_view s = data_.substr(pos_, n);
    pos_ += n;
    return s;
}

Result<std::string_view> MsgpackReader::ReadBin() {
    FERRY_RETURN_IF_ERROR(Need(1));
    const size_t at = pos_;
    const uint8_t b = uint8_t(data_[pos_]);
    if (b < 0xc4 || b > 0xc6) {
        return InvalidArgumentError(fmt::format("msgpack: bytes wanted at offset {}", at));
    }
    ++pos_;
    FERRY_ASSIGN_OR_RETURN(size_t n, Length(size_t(1) << (b - 0xc4)));
    FERRY_RETURN_IF_ERROR(Need(n));
    std::string_view s = data_.substr(pos_, n);
    pos_ += n;
    return s;
}

Result<size_t> MsgpackReader::ReadArray() {
    FERRY_RETURN_IF_ERROR(Need(1));
    const size_t at = pos_;
    const uint8_t b = uint8_t(data_[pos_]);
    size_t n = 0;
    if ((b & 0xf0) == 0x90) {
        n = b & 0x0f;
        ++pos_;
    } else if (b == 0xdc || b == 0xdd) {
        ++pos_;
        FERRY_ASSIGN_OR_RETURN(n, Length(b == 0xdc ? 2 : 4));
    } else {
        return InvalidArgumentError(fmt::format("msgpack: array wanted at offset {}", at));
    }
    // Every element takes a byte at least: a count beyond the bytes left is a lie.
    FERRY_RETURN_IF_ERROR(Need(n));
    return n;
}

Result<size_t> MsgpackReader::ReadMap() {
    FERRY_RETURN_IF_ERROR(Need(1));
    const size_t at = pos_;
    const uint8_t b = uint8_t(data_[pos_]);
    size_t n = 0;
    if ((b & 0xf0) == 0x80) {
        n = b & 0x0f;
        ++pos_;
    } else if (b == 0xde || b == 0xdf) {
        ++pos_;
        FERRY_ASSIGN_OR_RETURN(n, Length(b == 0xde ? 2 : 4));
    } else {
        return InvalidArgumentError(fmt::format("msgpack: map wanted at offset {}", at));
    }
    if (n > (data_.size() - pos_) / 2) {
        return InvalidArgumentError(
            fmt::format("msgpack: map at offset {} claims {} pairs", at, n));
    }
    return n;
}

Status MsgpackReader::Skip(int depth) {
    if (depth <= 0)
        return InvalidArgumentError(fmt::format("msgpack: nested too deep at offset {}", pos_));
    FERRY_ASSIGN_OR_RETURN(Type t, Peek());
    const uint8_t b = uint8_t(data_[pos_]);
    switch (t) {
        case Type::kNil:
        case Type::kBool:
            ++pos_;
            return Status::Ok();
        case Type::kInt:
            if (b == 0xcf) {
                ++pos_;
                return Be(8).status();
            }
            return ReadInt().status();
        case Type::kFloat:
            return ReadNumber().status();
        case Type::kStr:
            return ReadStr().status();
        case Type::kBin:
            return ReadBin().status();
        case Type::kArray: {
            FERRY_ASSIGN_OR_RETURN(size_t n, ReadArray());
            for (size_t i = 0; i < n; ++i) FERRY_RETURN_IF_ERROR(Skip(depth - 1));
            return Status::Ok();
        }
        case Type::kMap: {
            FERRY_ASSIGN_OR_RETURN(size_t n, ReadMap());
            for (size_t i = 0; i < 2 * n; ++i) FERRY_RETURN_IF_ERROR(Skip(depth - 1));
            return Status::Ok();
        }
        case Type::kExt: {
            ++pos_;
            size_t n = 0;
            if (b >= 0xd4 && b <= 0xd8) {
                n = size_t(1) << (b - 0xd4);
            } else {
                FERRY_ASSIGN_OR_RETURN(n, Length(size_t(1) << (b - 0xc7)));
            }
            FERRY_RETURN_IF_ERROR(Need(n + 1));  // the type byte, then the data
            pos_ += n + 1;
            return Status::Ok();
        }
    }
    return Status::Ok();
}

}  // namespace ferry
