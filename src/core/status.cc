#include "ferry/status.h"

namespace ferry {

std::string_view CodeName(Code code) {
    switch (code) {
        case Code::kOk:
            return "OK";
        case Code::kCancelled:
            return "Cancelled";
        case Code::kUnknown:
            return "Unknown";
        case Code::kInvalidArgument:
            return "InvalidArgument";
        case Code::kDeadlineExceeded:
            return "DeadlineExceeded";
        case Code::kNotFound:
            return "NotFound";
        case Code::kAlreadyExists:
            return "AlreadyExists";
        case Code::kPermissionDenied:
            return "PermissionDenied";
        case Code::kResourceExhausted:
            return "ResourceExhausted";
        case Code::kFailedPrecondition:
            return "FailedPrecondition";
        case Code::kAborted:
            return "Aborted";
        case Code::kOutOfRange:
            return "OutOfRange";
        case Code::kUnimplemented:
            return "Unimplemented";
        case Code::kInternal:
            return "Internal";
        case Code::kUnavailable:
            return "Unavailable";
        case Code::kDataLoss:
            return "DataLoss";
    }
    return "Unknown";
}

std::string Status::ToString() const {
    if (ok()) {
        return "OK";
    }
    std::string out(CodeName(code_));
    out += ": ";
    out += message_;
    return out;
}

Status Status::WithContext(std::string_view context) const {
    if (ok()) {
        return *this;
    }
    std::string msg(context);
    msg += ": ";
    msg += message_;
    return Status(code_, std::move(msg));
}

Status CancelledError(std::string m) { return Status(Code::kCancelled, std::move(m)); }
Status InvalidArgumentError(std::string m) { return Status(Code::kInvalidArgument, std::move(m)); }
Status DeadlineExceededError(std::string m) {
    return Status(Code::kDeadlineExceeded, std::move(m));
}
Status NotFoundError(std::string m) { return Status(Code::kNotFound, std::move(m)); }
Status AlreadyExistsError(std::string m) { return Status(Code::kAlreadyExists, std::move(m)); }
Status PermissionDeniedError(std::string m) {
    return Status(Code::kPermissionDenied, std::move(m));
}
Status ResourceExhaustedError(std::string m) {
    return Status(Code::kResourceExhausted, std::move(m));
}
Status FailedPreconditionError(std::string m) {
    return Status(Code::kFailedPrecondition, std::move(m));
}
Status OutOfRangeError(std::string m) { return Status(Code::kOutOfRange, std::move(m)); }
Status UnimplementedError(std::string m) { return Status(Code::kUnimplemented, std::move(m)); }
Status InternalError(std::string m) { return Status(Code::kInternal, std::move(m)); }
Status UnavailableError(std::string m) { return Status(Code::kUnavailable, std::move(m)); }
Status DataLossError(std::string m) { return Status(Code::kDataLoss, std::move(m)); }

}  // namespace ferry
