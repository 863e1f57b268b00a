// Status and Result<T>: how every fallible ferry call reports failure.
//
// A Status is a canonical code plus a message with context ("tcp: connect 127.0.0.1:7301:
// connection refused"). Result<T> holds either a T or a non-OK Status. Both are cheap to move,
// are [[nodiscard]], and never throw. Thread-compatible (like std::string).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace ferry {

// Canonical codes, numbered as in Abseil/gRPC so they read the same across systems. The numbers
// travel on the wire (docs/wire-protocol.md): never renumber.
enum class Code : uint8_t {
    kOk = 0,
    kCancelled = 1,
    kUnknown = 2,
    kInvalidArgument = 3,
    kDeadlineExceeded = 4,
    kNotFound = 5,
    kAlreadyExists = 6,
    kPermissionDenied = 7,
    kResourceExhausted = 8,
    kFailedPrecondition = 9,
    kAborted = 10,
    kOutOfRange = 11,
    kUnimplemented = 12,
    kInternal = 13,
    kUnavailable = 14,
    kDataLoss = 15,
};

// "InvalidArgument", "Unavailable", ...
std::string_view CodeName(Code code);

class [[nodiscard]] Status {
  public:
    Status() = default;
    Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

    static Status Ok() { return Status(); }

    bool ok() const { return code_ == Code::kOk; }
    Code code() const { return code_; }
    const std::string& message() const { return message_; }

    // "Unavailable: tcp: peer prefill-0 closed the connection"
    std::string ToString() const;

    // Returns a copy whose message is "context: message"; the code is kept.
    Status WithContext(std::string_view context) const;

    friend bool operator==(const Status& a, const Status& b) {
        return a.code_ == b.code_ && a.message_ == b.message_;
    }

  private:
    Code code_ = Code::kOk;
    std::string message_;
};

Status CancelledError(std::string message);
Status InvalidArgumentError(std::string message);
Status DeadlineExceededError(std::string message);
Status NotFoundError(std::string message);
Status AlreadyExistsError(std::string message);
Status PermissionDeniedError(std::string message);
Status ResourceExhaustedError(std::string message);
Status FailedPreconditionError(std::string message);
Status OutOfRangeError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);
Status UnavailableError(std::string message);
Status DataLossError(std::string message);

// Either a value or a non-OK Status. Accessing the value of an error Result is a programming
// error: value(), * and -> then throw std::bad_variant_access, in every build; check ok() first.
template <typename T>
class [[nodiscard]] Result {
  public:
    Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
    Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
        if (std::get<Status>(v_).ok()) {
            v_ = Status(Code::kInternal, "Result constructed from an OK status without a value");
        }
    }

    bool ok() const { return std::holds_alternative<T>(v_); }
    const Status& status() const {
        static const Status kOkStatus;
        return ok() ? kOkStatus : std::get<Status>(v_);
    }

    T& value() & { return std::get<T>(v_); }
    const T& value() const& { return std::get<T>(v_); }
    T&& value() && { return std::get<T>(std::move(v_)); }

    T& operator*() & { return value(); }
    const T& operator*() const& { return value(); }
    T&& operator*() && { return std::move(*this).value(); }
    T* operator->() { return &value(); }
    const T* operator->() const { return &value(); }

  private:
    std::variant<T, Status> v_;
};

}  // namespace ferry

#define FERRY_CONCAT_INNER_(a, b) a##b
#define FERRY_CONCAT_(a, b) FERRY_CONCAT_INNER_(a, b)

// Returns the Status from the enclosing function if `expr` is not OK.
#define FERRY_RETURN_IF_ERROR(expr)             \
    do {                                        \
        ::ferry::Status ferry_status_ = (expr); \
        if (!ferry_status_.ok()) {              \
            return ferry_status_;               \
        }                                       \
    } while (0)

// `FERRY_ASSIGN_OR_RETURN(auto x, MakeX());` binds the value or returns the error.
#define FERRY_ASSIGN_OR_RETURN(lhs, expr) \
    FERRY_ASSIGN_OR_RETURN_IMPL_(FERRY_CONCAT_(ferry_result_, __LINE__), lhs, expr)
#define FERRY_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
    auto tmp = (expr);                               \
    if (!tmp.ok()) {                                 \
        return tmp.status();                         \
    }                                                \
    lhs = std::move(tmp).value()
